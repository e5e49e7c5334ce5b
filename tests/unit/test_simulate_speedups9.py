"""The ninth simulator speed-ups (issue 17, deliverable 4b: Optimus at 100,000 jobs) against their references, bit for
bit: an Optimus round's throughput-model refits run together (`refit_many`) and leave each model as its own `refit`
does (coefficients, fit MAPE, status, the error it raised), on random problems and through whole simulations; the
scheduling pass's inline `Cluster.refuses` (`Cluster.fit_limit`) refuses what `refuses` refuses."""
from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest

from recforge.elastic.optimizer import PodPlan
from recforge.elastic.optimizer.models import throughput_model as tm
from recforge.elastic.optimizer.models.throughput_model import (
    LOCAL_CANDIDATES,
    PS_TERMS,
    Allocation,
    ModelFitError,
    OnlineThroughputModel,
    Sample,
    ThroughputModel,
    refit_many,
)
from recforge.elastic.simulate import ClusterSpec, SimParams, TraceParams, generate_trace, make_policy
from recforge.elastic.simulate import cluster as cluster_mod
from recforge.elastic.simulate import policies as policies_mod
from recforge.elastic.simulate.cluster import Cluster, GiB
from recforge.elastic.simulate.engine import Simulation
from recforge.elastic.simulate.policies import GENERIC_PRIOR, GENERIC_TR_PRIOR, TR_TERMS


def _same(a, b) -> bool:
    """Equal to the bit (NaN equal to NaN), through tuples, lists and dicts."""
    if isinstance(a, float) and isinstance(b, float):
        return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _state(m: OnlineThroughputModel, result) -> tuple:
    mod = m.model
    got = (type(result).__name__, str(result)) if isinstance(result, BaseException) else result
    model = None if mod is None else (mod.terms, mod.coef, mod.fit_mape, mod.n_points, mod.meta)
    return got, model, m.status, m._since, len(m.samples)


def _reference(models) -> list:
    """The committed code: each model's own `refit`, a ValueError kept in its place."""
    out = []
    for m in models:
        try:
            out.append(m.refit())
        except ValueError as e:
            out.append(e)
    return out


def _random_prior(rng: random.Random, terms: tuple[str, ...]) -> ThroughputModel | None:
    pick = rng.random()
    if pick < 0.1:
        return None
    if pick < 0.5 and terms == TR_TERMS:
        return GENERIC_TR_PRIOR
    if pick < 0.6 and terms == PS_TERMS:
        return GENERIC_PRIOR
    pterms = terms if rng.random() < 0.7 else tuple(rng.sample(LOCAL_CANDIDATES, rng.randint(1, 4)))
    coef = tuple(0.0 if rng.random() < 0.25 else rng.uniform(1e-5, 0.1) * 10 ** rng.randint(-2, 1) for _ in pterms)
    return ThroughputModel(pterms, coef)


def _random_model(rng: random.Random) -> OnlineThroughputModel:
    shape = rng.random()
    if shape < 0.5:
        terms = TR_TERMS
    elif shape < 0.7:
        terms = PS_TERMS
    else:
        terms = ("const", *rng.sample([t for t in LOCAL_CANDIDATES if t != "const"], rng.randint(0, 3)))
    ps = terms == PS_TERMS
    m = OnlineThroughputModel(terms, _random_prior(rng, terms), min_points=rng.choice([1, 2, 3, 3, 3, 4]),
                              prior_strength=rng.choice([0.3, 0.3, 0.3, 1, 2.5, 0.0, 1e-3]),
                              max_samples=rng.choice([5, 30, 200, 200]))
    configs = [Allocation(rng.randint(1, 24), rng.choice([1.0, 2.0, 4.0, 8.0, 3.5]), rng.choice([256, 512, 2048]),
                          servers=rng.randint(1, 6) if ps else 0, cpu_per_server=rng.choice([2.0, 4.0]) if ps else 0.0,
                          host_cores=rng.choice([None, None, 32.0, 8.0]))
               for _ in range(rng.randint(1, 6))]
    extreme = rng.random() < 0.05
    for _ in range(rng.choice([0, 1, 2, 3, 5, 8, 20, 40, 120, 250])):
        a = rng.choice(configs)
        rate = a.workers * a.batch_size / (0.05 + 1e-4 * a.batch_size / a.cpu_per_worker) * rng.uniform(0.8, 1.2)
        if extreme and rng.random() < 0.2:
            rate = rng.choice([1e-300, 1e300, 5e-324, 1.7e308])
        m.add(Sample(a, rate, weight=rng.choice([1.0, 1.0, 1.0, 2.0, 0.5, 3.0])), refit=False)
    return m


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the extreme rates overflow, in `refit` too)
@pytest.mark.parametrize("seed", range(6))
def test_refit_many_equals_each_models_refit(seed):
    rng = random.Random(seed)
    models = [_random_model(rng) for _ in range(120)]
    twins = copy.deepcopy(models)
    for rnd in range(3):  # refit, add more samples, refit again (the models' kept columns move on between refits)
        got = refit_many(models)
        want = _reference(twins)
        for m, g, t, w in zip(models, got, twins, want, strict=True):
            assert _same(_state(m, g), _state(t, w)), (rnd, m.terms, m.prior, len(m.samples))
        state = random.Random(seed * 100 + rnd)
        for m, t in zip(models, twins, strict=True):
            for _ in range(state.choice([0, 1, 3, 7])):
                a = Allocation(state.randint(1, 16), 4.0, 512)
                s = Sample(a, state.uniform(500.0, 5e4))
                m.add(s, refit=False)
                t.add(s, refit=False)
    kinds = {type(g).__name__ for g in got}
    assert "bool" in kinds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the extreme rates overflow, in `refit` too)
def test_refit_many_covers_the_batched_path_and_errors():
    """The random problems above reach the batched path, the one-by-one path, and refits that fail in both."""
    rng = random.Random(11)
    models = [_random_model(rng) for _ in range(400)]
    batched = [m._batchable() for m in models]
    assert sum(batched) > 100 and sum(not b for b in batched) > 50
    twins = copy.deepcopy(models)
    got, want = refit_many(models), _reference(twins)
    assert any(isinstance(w, ModelFitError) for w, b in zip(want, batched, strict=True) if b)  # an IRLS fit failing
    for m, g, t, w in zip(models, got, twins, want, strict=True):
        assert _same(_state(m, g), _state(t, w))


def test_refit_many_of_one_model_and_of_none():
    assert refit_many([]) == []
    m = OnlineThroughputModel(TR_TERMS, GENERIC_TR_PRIOR)
    for w in (1, 2, 4, 4, 8):
        m.add(Sample(Allocation(w, 4.0, 512), 1000.0 * w ** 0.8), refit=False)
    t = copy.deepcopy(m)
    assert refit_many([m]) == [True] and t.refit()
    assert m.model is not None and t.model is not None
    assert m.model.coef == t.model.coef and m.model.fit_mape == t.model.fit_mape and m.status == t.status
    assert m.status.startswith("fitted on 5 samples / 4 configurations")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the extreme rates overflow, in `refit` too)
def test_refit_many_without_the_compiled_core(monkeypatch):
    """scipy without the private NNLS core: the batch goes through `solve_nnls`' public path, to the same values."""
    rng = random.Random(5)
    models = [_random_model(rng) for _ in range(80)]
    twins = copy.deepcopy(models)
    want = _reference(twins)
    monkeypatch.setattr(tm, "_NNLS_CORE", None)
    got = refit_many(models)
    for m, g, t, w in zip(models, got, twins, want, strict=True):
        assert _same(_state(m, g), _state(t, w))


def test_matrix_vector_products_on_views_equal_fresh_arrays():
    """The batch multiplies each job's rows as a view into the stacked array (at any offset, into `out`): BLAS gives
    the values it gives on the fresh array `_fit_columns` builds."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 210))
        x = rng.random((n, 3)) * 10.0 ** rng.integers(-6, 3, size=(1, 3))
        c = rng.random(3) * 10.0 ** rng.integers(-6, 1, size=3)
        off = int(rng.integers(0, 9))
        big = np.empty((n + 12, 3))
        big[off:off + n] = x
        dst = np.empty(n + 12)
        np.matmul(big[off:off + n], c, out=dst[off:off + n])
        assert np.array_equal(dst[off:off + n], x @ c)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 9])
def test_stacked_products_equal_each_jobs_own_product(k):
    """`_stacked_products` (one stacked matmul per sample count over the batch's layout) gives each job's rows what
    `X0 @ coef` gives on the job's own fresh (n, k) array, to the bit, for every k (BLAS groups rows and terms)."""
    rng = np.random.default_rng(k)
    ns = sorted(int(x) for x in rng.integers(1, 40, size=60))
    blocks, starts, groups, s = [], [], [], 0
    for j, n in enumerate(ns):
        if not groups or groups[-1][2] != n:
            groups.append((j, j + 1, n, s))
        else:
            groups[-1] = (groups[-1][0], j + 1, n, groups[-1][3])
        blocks.append(rng.random((n + k, k)) * 10.0 ** rng.integers(-6, 3, size=(1, k)))
        starts.append(s)
        s += n + k
    X = np.concatenate(blocks)
    C = rng.random((len(ns), k, 1)) * 10.0 ** rng.integers(-6, 1, size=(len(ns), k, 1))
    C[rng.random(C.shape) < 0.2] = 0.0
    out = np.full(len(X), np.nan)
    tm._stacked_products(X, C, out, groups, k)
    for j, n in enumerate(ns):
        s = starts[j]
        assert np.array_equal(out[s:s + n], X[s:s + n].copy() @ C[j, :, 0].copy()), (k, n)
        assert np.isnan(out[s + n:s + n + k]).all()  # the prior rows are left alone


def _optimus_run(n_jobs: int, nodes: int, seed: int) -> dict:
    tp = TraceParams(shape="torchrec", n_jobs=n_jobs, arrival_window_h=24.0)
    sim = Simulation(generate_trace(tp, seed=seed), make_policy("optimus"), ClusterSpec(nodes=nodes),
                     SimParams(eviction_per_node_h=0.02), seed=seed)
    r = sim.run()
    r["events"] = sim.events
    return r


@pytest.mark.parametrize("n_jobs,nodes,seed", [(150, 10, 3), (300, 20, 1)])
def test_optimus_runs_the_same_with_the_models_refitted_one_by_one(monkeypatch, n_jobs, nodes, seed):
    fast = _optimus_run(n_jobs, nodes, seed)
    monkeypatch.setattr(policies_mod, "refit_many", _reference)
    ref = _optimus_run(n_jobs, nodes, seed)
    assert fast["events"] == ref["events"] and fast["plan_changes"] == ref["plan_changes"] > 0
    assert _same(fast, ref)


def _bucket_bound_brute(cl: Cluster, c: float, m: float) -> float:
    """How many identical pods of (c cores, m bytes) the bucket bound lets through, counted plainly node by node from
    the nodes' actual free cores and memory (not from the cluster's histograms): each node's free cores rounded up to
    whole cores and its free memory up to whole GiB (clamped to the node's size + 1), and as many pods as those
    rounded-up amounts hold (the margins `_vc` / `_vm` add); summed over the nodes, the smaller of the two counts."""
    if not cl.bound:
        return math.inf
    top_c = math.ceil(cl.spec.cpu_per_node) + 1
    top_m = math.ceil(cl.spec.memory_per_node / GiB) + 1
    lim: float = math.inf
    if c > 0:
        n_c = 0
        for f in cl.free_cpu.tolist():
            cores = min(max(math.ceil(f - 1e-7), 0), top_c)
            n_c += math.floor((cores + 1e-6) / c)
        lim = n_c
    if m > 0:
        n_m = 0
        for f in cl.free_mem.tolist():
            gib = min(max(math.ceil((f - 1e-3) / GiB), 0), top_m)
            n_m += math.floor((gib * GiB + 1.0) / m)
        lim = min(lim, n_m)
    return lim


def _pods_that_fit(cl: Cluster, c: float, m: float, cap: int = 10_000) -> int:
    """How many identical pods of (c cores, m bytes) the nodes really hold (`_first_fit`'s per-node count)."""
    total = 0
    for fc, fm in zip(cl.free_cpu.tolist(), cl.free_mem.tolist(), strict=True):
        if fc >= c - 1e-9 and fm >= m - 1e-3:
            k = cap
            if c > 0:
                k = min(k, int((fc + 1e-9) // c))
            if m > 0:
                k = min(k, int((fm + 1e-3) // m))
            total += k
    return total


@pytest.mark.parametrize("bound", [True, False])
def test_fit_limit_refuses_what_refuses_refuses(bound):
    """`Cluster.fit_limit` equals a plain node-by-node count of the bucket bound over the nodes' actual free capacity
    (so the histograms it reads are in step with the nodes, and `_may_fit` / `refuses`, which read it, refuse by the
    bound), is never below what really fits, and the scheduling pass's check (the free totals, then `fit_limit`)
    refuses what `Cluster.refuses` refuses, through 500 random placements and releases (pods of zero cores or memory
    too)."""
    cl = Cluster(ClusterSpec(nodes=30, cpu_per_node=32.0, memory_per_node=128 * GiB), bound=bound)
    rng = random.Random(7)
    placed: list = []
    shapes = [(c, m * GiB) for c in (0.0, 0.5, 1.0, 2.0, 3.3, 8.0, 16.0) for m in (0.0, 1.0, 2.5, 8.0, 30.0)]
    checked = refused = bounded = 0
    for _ in range(500):
        if placed and rng.random() < 0.4:
            pods, where = placed.pop(rng.randrange(len(placed)))
            cl.release(pods, where)
        else:
            pods = [rng.choice(shapes[1:])] * rng.randint(1, 12)
            where = cl.place(pods)
            if where is not None:
                placed.append((pods, where))
        for _ in range(6):
            c, m = rng.choice(shapes)
            n = rng.randint(1, 120)
            lim = cl.fit_limit(c, m)
            assert lim == _bucket_bound_brute(cl, c, m), (c, m)
            if c > 0 or m > 0:
                assert lim >= _pods_that_fit(cl, c, m), (c, m)  # a bound: never refuses what fits
            got = (c * n > cl.free_cpu_total + 1e-6 or m * n > cl.free_mem_total + 1.0 or n > lim)
            assert got == cl.refuses(c, m, n), (c, m, n)
            checked += 1
            refused += got
            # refused by the bound alone (the free totals let them through)
            bounded += (n > lim and c * n <= cl.free_cpu_total + 1e-6 and m * n <= cl.free_mem_total + 1.0)
    assert 0 < refused < checked
    if bound:
        assert bounded > 0
    else:
        assert bounded == 0 and cl.fit_limit(1.0, GiB) == math.inf


def _placements_logged(sim: Simulation) -> list:
    """Record every `place` a scheduling pass asks of the cluster (the real placement runs): (pods, whether
    `Cluster.refuses` refused them beforehand, for a workers-only job; None for mixed shapes)."""
    cl, log = sim.cluster, []
    real_place, real_pass = cl.place, sim._schedule_pending
    in_pass = [False]

    def place(pods):
        if in_pass[0]:
            one = bool(pods) and pods.count(pods[0]) == len(pods)
            log.append((pods, cl.refuses(pods[0][0], pods[0][1], len(pods)) if one else None))
        return real_place(pods)

    def schedule_pending(t):
        in_pass[0] = True
        try:
            return real_pass(t)
        finally:
            in_pass[0] = False
    cl.place = place  # type: ignore[method-assign]
    sim._schedule_pending = schedule_pending  # type: ignore[method-assign]
    return log


def test_scheduling_pass_refuses_by_free_memory_without_placing():
    """The pass's inline refusal compares a workers-only job's memory with the free memory total: a job that only
    that comparison refuses (its cores fit, the roomiest node holds one pod, the bucket bound lets it through) is a
    miss without a `place` call. (`place` would refuse it too, so dropping the comparison changes no decision, only
    this.)"""
    trace = generate_trace(TraceParams(shape="torchrec", n_jobs=3, arrival_window_h=1.0), seed=3)
    sim = Simulation(trace, make_policy("static"), ClusterSpec(nodes=4), SimParams(eviction_per_node_h=0.0), seed=3)
    cl = sim.cluster
    node_m = cl.spec.memory_per_node
    # node 0: 1 GiB free; nodes 1-3: 0.3 GiB free (each node's memory bucket rounds up to 1 GiB); cores mostly free
    fill = [(1.0, node_m - 1 * GiB)] + [(1.0, node_m - 0.3 * GiB)] * 3
    assert [cl.place([pod]) for pod in fill] == [[0], [1], [2], [3]]
    j = sim.trace[0]
    sim._arrive(j.job_id, 0.0)
    r = sim.runs[j.job_id]
    assert r.status == "pending"
    r.plan = PodPlan(workers=2, cpu_per_worker=1.0, memory_per_worker=1 * GiB)  # 2 GiB against 1.9 GiB free
    sim._pend(r)
    c, m, n = 1.0, 1 * GiB, 2
    assert c * n <= cl.free_cpu_total and m <= float(cl.free_mem.max()) and n <= cl.fit_limit(c, m)
    assert m * n > cl.free_mem_total + 1.0 and cl.refuses(c, m, n)
    log = _placements_logged(sim)
    sim._schedule_pending(0.0)
    assert log == [] and r.status == "pending" and cl.place([(c, m)] * n) is None
    # node 0 at 2.2 GiB free (3.1 GiB in all): the pass places the job
    cl.release([(1.0, node_m - 1 * GiB)], [0])
    assert cl.place([(1.0, node_m - 2.2 * GiB)]) == [0]
    sim._schedule_pending(0.0)
    assert len(log) == 1 and log[0][1] is False and r.status == "running"


@pytest.mark.parametrize("policy", ["optimus", "static", "dlrover"])
def test_scheduling_pass_places_only_what_refuses_lets_through(policy):
    """Through whole runs: every workers-only job a scheduling pass hands to `place`, `Cluster.refuses` lets through
    (the pass's inline check refused all the others, by cores, memory and the bucket bound)."""
    tp = TraceParams(shape="torchrec", n_jobs=250, arrival_window_h=24.0)
    sim = Simulation(generate_trace(tp, seed=5), make_policy(policy), ClusterSpec(nodes=8),
                     SimParams(eviction_per_node_h=0.02), seed=5)
    log = _placements_logged(sim)
    sim.run()
    one = [refused for _, refused in log if refused is not None]
    assert len(one) > 50 and not any(one)


def _cluster_walk(seed: int, nodes: int, steps: int = 700) -> list:
    """Random placements, releases, resizes that do not fit (take back) and failed placements (undone): everything
    the cluster's free capacity and histograms went through, and every placement's answer."""
    cl = Cluster(ClusterSpec(nodes=nodes, cpu_per_node=32.0, memory_per_node=128 * GiB))
    rng = random.Random(seed)
    placed: list = []
    seen: list = []
    shapes = [(c, m * GiB) for c in (0.5, 1.0, 2.0, 3.3, 8.0, 0.1) for m in (0.7, 2.5, 8.0, 30.0, 1.1)]
    for _ in range(steps):
        u = rng.random()
        if placed and u < 0.35:
            pods, where = placed.pop(rng.randrange(len(placed)))
            cl.release(pods, where)
        elif placed and u < 0.45:  # a resize that did not fit: released, then taken back where it was
            pods, where = placed[rng.randrange(len(placed))]
            cl.release(pods, where)
            cl.take(pods, where)
        else:
            pods = [rng.choice(shapes)] * rng.randint(1, 16)
            if rng.random() < 0.3:  # a PS job: two shapes
                pods = pods + [rng.choice(shapes)] * rng.randint(1, 4)
            where = cl.place(pods)
            seen.append(where)
            if where is not None:
                placed.append((pods, where))
        seen.append((cl.free_cpu.tobytes(), cl.free_mem.tobytes(), cl._hc.tobytes(), cl._hm.tobytes(),
                     cl.free_cpu_total, cl.free_mem_total, cl.version))
    return seen


@pytest.mark.parametrize("seed,nodes", [(0, 12), (1, 40), (2, 300), (3, 6)])
def test_few_node_updates_equal_the_numpy_path(monkeypatch, seed, nodes):
    """`_change` / `_per_pod` on a few nodes in python floats (`_set_few`) against the numpy path (the committed code:
    `_FEW_NODES` 0 sends every update there): the free capacities, histograms, totals, version and placements of
    every step, to the bit."""
    fast = _cluster_walk(seed, nodes)
    monkeypatch.setattr(cluster_mod, "_FEW_NODES", 0)
    ref = _cluster_walk(seed, nodes)
    assert len(fast) == len(ref) and fast == ref
    assert sum(w is not None for w in fast if isinstance(w, list)) > 50
