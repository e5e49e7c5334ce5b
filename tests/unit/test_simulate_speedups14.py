"""The fourteenth simulator speed-ups (Optimus at 100,000 jobs) against their references, bit for bit: `add`'s row and
configuration key read once per Allocation, the scheduling pass's bound read lazily (`Cluster.over_limit`),
`learn_memory`'s shard sizes on tables sorted once, the greedy on tuples (`OptimusAllocator.allocate_rows`), the
convergence fits in one reused buffer, `_noise`'s digest halves by `struct`, `_advance`'s plan totals per plan and the
round's resized plan built without `dataclasses.replace`; and whole Optimus runs with every reference patched in."""
from __future__ import annotations

import hashlib
import heapq
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from recforge.elastic.optimizer import JobDescription, JobLimits, PodPlan
from recforge.elastic.optimizer.models.memory_model import _shard_bytes_reference, embedding_shard_bytes
from recforge.elastic.optimizer.models.throughput_model import (
    Allocation,
    OnlineThroughputModel,
    Sample,
    _config_key,
    refit_many,
    row_values,
)
from recforge.elastic.simulate import ClusterSpec, SimParams, TraceParams, generate_trace, make_policy
from recforge.elastic.simulate import policies as pol
from recforge.elastic.simulate.cluster import Cluster, GiB
from recforge.elastic.simulate.engine import JobRun, Simulation
from recforge.elastic.simulate.policies import (
    GENERIC_TR_PRIOR,
    TR_TERMS,
    OptimusAllocator,
    _OptimusJob,
    _shard_of_sorted,
    fit_convergence,
    fit_convergence_many,
)
from test_simulate_speedups10 import SIZES, _walk


# ---- references: the committed code paths --------------------------------------------------------------------------
def _add_reference(m: OnlineThroughputModel, s: Sample, refit: bool = True) -> bool:
    """`add` reading the row and the key of every sample again (the committed path)."""
    m._row_of = (None, None, None)
    return m.add(s, refit=refit)


def _learn_memory_reference(st: _OptimusJob, workers: int, peak: float) -> None:
    if st.memory_known or not st.tables:
        return
    st.memory_known = True
    base = max(peak - embedding_shard_bytes(st.tables, workers), 0.0)
    w = 1
    while w < st.max_w and base + 1.2 * embedding_shard_bytes(st.tables, w) > 0.9 * st.mem:
        w += 1
    st.min_w = w


def _gain_reference(j: dict, w: int, cpu_total: float, mem_total: float) -> float:
    if w >= j["max_w"]:
        return 0.0
    thr = j["thr"]
    now, nxt = thr[w - 1], thr[w]
    if not (now > 0 and nxt > 0):
        return 0.0
    share = max(j["cpu"] / cpu_total, j["mem"] / mem_total)
    return j["remaining"] * (1.0 / now - 1.0 / nxt) / share


def _allocate_reference(jobs: list[dict], cpu_total: float, mem_total: float) -> dict[int, int]:
    """The greedy on dicts, `gain` called per worker (before the seventh session's inline form)."""
    free_c, free_m = cpu_total, mem_total
    out: dict[int, int] = {}
    heap: list = []
    for i, j in enumerate(jobs):
        need_c, need_m = j["min_w"] * j["cpu"], j["min_w"] * j["mem"]
        if need_c > free_c + 1e-9 or need_m > free_m + 1e-3:
            out[j["id"]] = 0
            continue
        free_c, free_m = free_c - need_c, free_m - need_m
        out[j["id"]] = j["min_w"]
        heapq.heappush(heap, (-_gain_reference(j, j["min_w"], cpu_total, mem_total), i, j["min_w"]))
    while heap:
        neg, i, w = heapq.heappop(heap)
        if -neg <= 0:
            break
        j = jobs[i]
        if j["cpu"] > free_c + 1e-9 or j["mem"] > free_m + 1e-3:
            continue
        free_c, free_m = free_c - j["cpu"], free_m - j["mem"]
        w += 1
        out[j["id"]] = w
        heapq.heappush(heap, (-_gain_reference(j, w, cpu_total, mem_total), i, w))
    return out


def _noise_reference(self: Simulation, r: JobRun) -> float:
    if r.noise_at[0] == r.ticks:
        return r.noise_at[1]
    h = hashlib.blake2b(f"{self.seed},{r.job.job_id},{r.ticks}".encode(), digest_size=8).digest()
    u1 = (int.from_bytes(h[:4], "little") + 0.5) / 2**32
    u2 = int.from_bytes(h[4:], "little") / 2**32
    v = math.exp(self.params.noise * math.sqrt(-2.0 * math.log(u1)) * math.cos(2 * math.pi * u2))
    r.noise_at = (r.ticks, v)
    return v


def _advance_reference(self: Simulation, r: JobRun, t: float) -> None:
    dt = t - r.t_last
    if dt > 0 and r.status == "running":
        r.done = min(r.job.total_samples, r.done + r.rate * dt)
        a = self.acc
        a["alloc_cpu_s"] += r.plan.cpu_total * dt
        a["used_cpu_s"] += r.used_cpu * dt
        a["alloc_mem_s"] += r.plan.memory_total * dt
        a["used_mem_s"] += r.used_mem * dt
    r.t_last = t


def _fit_many_reference(ks, losses, grid=32):
    return [fit_convergence(np.asarray(k, float), np.asarray(loss, float), grid)
            for k, loss in zip(ks, losses, strict=True)]


# ---- the throughput model's add ---------------------------------------------------------------------------------
def _state(m: OnlineThroughputModel):
    mat = m._columns() if m.samples else np.zeros((0, 8))
    return (list(m.samples), list(m._rows), list(m._thr), dict(m._configs), m.distinct_configs, mat.tolist(),
            m.status, None if m.model is None else (m.model.terms, m.model.coef, m.model.fit_mape))


@pytest.mark.parametrize("seed", range(6))
def test_add_with_the_row_read_once_per_allocation_equals_the_reference(seed):
    rng = random.Random(seed)
    allocs = [Allocation(rng.randint(1, 12), rng.choice([1.0, 2.0, 4.0]), rng.choice([256, 512])) for _ in range(4)]
    allocs.append(Allocation(allocs[0].workers, allocs[0].cpu_per_worker, allocs[0].batch_size))  # equal, not same
    fast = OnlineThroughputModel(TR_TERMS, GENERIC_TR_PRIOR, min_points=3, max_samples=rng.choice([5, 17, 200]))
    ref = OnlineThroughputModel(TR_TERMS, GENERIC_TR_PRIOR, min_points=3, max_samples=fast.max_samples)
    a = rng.choice(allocs)
    for step in range(400):
        if rng.random() < 0.1:
            a = rng.choice(allocs)  # mostly runs of one allocation object, as a policy reports them
        rate = rng.choice([rng.uniform(100, 1e4), 0.0, math.nan]) if rng.random() < 0.05 else rng.uniform(100, 1e4)
        s = Sample(a, rate)
        refit = rng.random() < 0.3
        assert fast.add(s, refit=refit) == _add_reference(ref, s, refit=refit)
        if rng.random() < 0.02:  # samples changed from outside: both rebuild what they keep
            cut = rng.randint(0, len(fast.samples))
            fast.samples, ref.samples = fast.samples[cut:], ref.samples[cut:]
        if step % 37 == 0:
            assert refit_many([fast]) == refit_many([ref])
        assert _state(fast) == _state(ref)
    assert fast._rows == [row_values(s.allocation) for s in fast.samples]
    keys: dict = {}
    for s in fast.samples:
        keys[_config_key(s.allocation)] = keys.get(_config_key(s.allocation), 0) + 1
    assert fast._configs == keys


# ---- learn_memory's shard sizes ---------------------------------------------------------------------------------
def test_shard_of_sorted_equals_embedding_shard_bytes():
    rng = random.Random(1)
    cases = [[], [5.0], [3.0, 3.0, 3.0], [0.0, -0.0, 1.0], [1e12, 1.0, 1e-3] * 5]
    cases += [[rng.choice([rng.uniform(1, 1e9), float(rng.randint(1, 8) * GiB)]) for _ in range(rng.randint(1, 60))]
              for _ in range(300)]
    for tables in cases:
        desc = sorted(tables, reverse=True)
        for w in (1, 2, 3, 7, 8, 16, 60, 61, 100):
            got = _shard_of_sorted(desc, w, True)
            assert got == embedding_shard_bytes(tables, w) == _shard_bytes_reference(tables, w)
    for bad in ([1.0, math.inf, 2.0], [math.nan, 1.0]):  # (not finite: embedding_shard_bytes decides)
        desc = sorted(bad, reverse=True)
        for w in (1, 2, 5):
            a, b = _shard_of_sorted(desc, w, False), embedding_shard_bytes(bad, w)
            assert a == b or (math.isnan(a) and math.isnan(b))
    with pytest.raises(ValueError):
        _shard_of_sorted([1.0], 0, True)


@pytest.mark.parametrize("seed", range(4))
def test_learn_memory_equals_the_reference(seed):
    rng = random.Random(seed)
    trace = generate_trace(TraceParams(shape="torchrec", n_jobs=60, arrival_window_h=24.0), seed=seed)
    for j in trace:
        req = PodPlan(**j.request)
        desc = JobDescription(dataset=j.scenario, model_family=j.family, requested=req,
                              total_samples=j.total_samples, parameter_server=False, table_bytes=j.tables)
        limits = JobLimits(cpu=max(req.cpu_total * 1.5, 32.0), memory=max(req.memory_total * 1.5, 128 * GiB),
                           max_memory_per_pod=128 * GiB * 0.95)
        fast, ref = _OptimusJob(j, desc, limits), _OptimusJob(j, desc, limits)
        workers, peak = rng.randint(1, 8), rng.uniform(0.1, 2.0) * req.memory_per_worker
        fast.learn_memory(workers, peak)
        _learn_memory_reference(ref, workers, peak)
        assert (fast.min_w, fast.memory_known) == (ref.min_w, ref.memory_known)
        fast.learn_memory(workers + 1, 0.0)  # (once known: nothing changes)
        assert fast.min_w == ref.min_w


# ---- the scheduling pass's bound ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,nodes,bound", [(0, 30, True), (1, 300, True), (2, 6, True), (3, 20, False)])
def test_over_limit_is_n_over_fit_limit(seed, nodes, bound):
    rng = random.Random(seed)
    cl = Cluster(ClusterSpec(nodes=nodes), bound=bound)

    def check(c, m):
        m *= GiB
        lim = cl.fit_limit(c, m)
        for n in {0, 1, 2, 3, 7, 40, 1000, int(lim) if math.isfinite(lim) else 5, int(lim) + 1 if math.isfinite(lim)
                  else 6}:
            assert cl.over_limit(c, m, n) == (n > lim)
    assert _walk(cl, rng, 300, SIZES, check) > 100


# ---- Optimus's greedy on tuples -------------------------------------------------------------------------------------
def _random_jobs(rng: random.Random, count: int) -> list[dict]:
    jobs = []
    for i in range(count):
        max_w = rng.randint(1, 12)
        min_w = rng.randint(1, max_w)
        thr = [rng.uniform(50, 500) * (w + 1) ** rng.uniform(-0.3, 1.0) for w in range(max_w)]
        for _ in range(rng.choice([0, 0, 1, 2])):  # zero, negative, NaN throughputs
            thr[rng.randrange(max_w)] = rng.choice([0.0, -3.0, math.nan])
        jobs.append({"id": 1000 + i, "min_w": min_w, "max_w": max_w, "cpu": rng.choice([1.0, 2.0, 4.0, 8.0]),
                     "mem": rng.choice([2.0, 8.0, 30.0]) * GiB, "remaining": rng.choice([rng.uniform(1e5, 1e9), 0.0]),
                     "thr": thr})
    return jobs


@pytest.mark.parametrize("seed", range(60))
def test_greedy_on_tuples_equals_the_reference(seed):
    rng = random.Random(seed)
    jobs = _random_jobs(rng, rng.randint(0, 40))
    cpu, mem = rng.choice([16.0, 64.0, 320.0]), rng.choice([64.0, 512.0, 1280.0]) * GiB
    want = _allocate_reference(jobs, cpu, mem)
    assert OptimusAllocator.allocate(jobs, cpu, mem) == want
    rows = [(j["id"], j["min_w"], j["max_w"], j["cpu"], j["mem"], j["remaining"], j["thr"]) for j in jobs]
    got = OptimusAllocator.allocate_rows(rows, cpu, mem)
    assert got == want and list(got) == list(want)  # (the same keys in the same order too)


# ---- convergence fits in one buffer ---------------------------------------------------------------------------------
def test_fit_convergence_many_in_a_buffer_equals_one_at_a_time():
    rng = np.random.default_rng(5)
    ks, losses = [], []
    for i in range(700):
        n = int(rng.choice([0, 1, 2, 3, 4, 8, 29, 30, 30, 30]))  # (>64 curves of one length: several blocks)
        k = np.sort(rng.uniform(0, 40, n))
        if i % 50 == 0 and n:
            k[:] = 3.0  # constant k: no fit
        loss = 1 / (rng.uniform(0.1, 2) * k + rng.uniform(1, 5)) + rng.uniform(0, 0.5) + rng.normal(0, 0.002, n)
        if i % 41 == 0:
            loss = loss[::-1].copy()  # rising losses
        ks.append(k.tolist())
        losses.append(loss.tolist())
    for grid in (32, 2, 64, 100):
        assert fit_convergence_many(ks, losses, grid) == _fit_many_reference(ks, losses, grid)
    assert fit_convergence_many([], []) == []


# ---- small pieces ------------------------------------------------------------------------------------------------
def test_noise_by_struct_equals_the_reference():
    trace = generate_trace(TraceParams(shape="torchrec", n_jobs=5, arrival_window_h=1.0), seed=0)
    for seed in (0, 1, 123456789):
        sim = Simulation(trace, make_policy("static"), ClusterSpec(nodes=2), SimParams(), seed)
        for j in trace:
            a, b = JobRun(job=j, plan=PodPlan(**j.request)), JobRun(job=j, plan=PodPlan(**j.request))
            for tick in list(range(200)) + [2**31, 2**40]:
                a.ticks = b.ticks = tick
                assert sim._noise(a) == _noise_reference(sim, b)


def test_resized_plan_equals_replace():
    rng = random.Random(2)
    for _ in range(200):
        p = PodPlan(rng.randint(1, 9), rng.choice([0.5, 1.0, 4.0]), rng.uniform(1, 64) * GiB, rng.choice([64, 512]),
                    rng.choice([0, 2]), rng.choice([0.0, 2.0]), rng.choice([0.0, 8.0 * GiB]))
        w = rng.randint(1, 40)
        new = type(p)(workers=int(w), cpu_per_worker=p.cpu_per_worker, memory_per_worker=p.memory_per_worker,
                      batch_size=p.batch_size, servers=p.servers, cpu_per_server=p.cpu_per_server,
                      memory_per_server=p.memory_per_server)
        assert new == replace(p, workers=int(w)) and type(new) is PodPlan


# ---- whole runs: every reference patched in -----------------------------------------------------------------------
def _run(shape: str, nodes: int, reference: bool, monkeypatch):
    tp = TraceParams(shape=shape, n_jobs=160, arrival_window_h=24.0)
    trace = generate_trace(tp, seed=4)
    sim = Simulation(trace, make_policy("optimus"), ClusterSpec(nodes=nodes), SimParams(eviction_per_node_h=0.02), 4)
    log: list = []
    with monkeypatch.context() as mp:
        if reference:
            mp.setattr(Simulation, "_noise", _noise_reference)
            mp.setattr(Simulation, "_advance", _advance_reference)
            mp.setattr(Cluster, "over_limit", lambda self, c, m, n: n > self.fit_limit(c, m))
            mp.setattr(OptimusAllocator, "allocate_rows", staticmethod(
                lambda rows, c, m: _allocate_reference(
                    [dict(zip(("id", "min_w", "max_w", "cpu", "mem", "remaining", "thr"), r, strict=True))
                     for r in rows], c, m)))
            mp.setattr(pol, "fit_convergence_many", _fit_many_reference)
            mp.setattr(Cluster, "place", _place_reference)
            mp.setattr(_OptimusJob, "learn_memory", _learn_memory_reference)
            mp.setattr(OnlineThroughputModel, "add", lambda self, s, refit=True: (
                setattr(self, "_row_of", (None, None, None)), _ADD(self, s, refit))[1])
        orig_set_rate = sim._set_rate

        def logged(r, t):
            log.append((t, r.job.job_id, r.plan, r.status, r.done))
            orig_set_rate(r, t)
        sim._set_rate = logged
        res = sim.run()
    return log, res, dict(sim.acc), sim.events


_ADD = OnlineThroughputModel.add


@pytest.mark.parametrize("shape,nodes", [("torchrec", 10), ("torchrec", 40), ("ps", 12)])
def test_whole_optimus_runs_equal_the_references(shape, nodes, monkeypatch):
    fast = _run(shape, nodes, False, monkeypatch)
    ref = _run(shape, nodes, True, monkeypatch)
    assert fast[3] == ref[3] and fast[2] == ref[2] and fast[0] == ref[0]
    assert fast[1]["per_job"] == ref[1]["per_job"] and fast[1]["plan_changes"] == ref[1]["plan_changes"]
    assert fast[1]["plan_changes"] > 0


# ---- a placement of one pod shape ------------------------------------------------------------------------------------
def _place_reference(cl: Cluster, pods: list) -> list | None:
    """The committed `place`: its groups, totals and bound checks, then the loop over the groups."""
    groups: dict = {}
    for i, pm in enumerate(pods):
        groups.setdefault(pm, []).append(i)
    tc = sum(c * len(ix) for (c, _), ix in groups.items())
    tm = sum(m * len(ix) for (_, m), ix in groups.items())
    if tc > cl.free_cpu_total + 1e-6 or tm > cl.free_mem_total + 1.0:
        return None
    if cl.bound and not all(cl._may_fit(c, m, len(ix)) for (c, m), ix in groups.items()):
        return None
    taken: list = []
    where = [0] * len(pods)
    start = cl._start
    for (c, m) in sorted(groups, key=lambda k: (-k[0], -k[1])):
        idx = groups[(c, m)]
        cand, cap = cl._first_fit(c, m, len(idx), start)
        if len(cand):
            cum = np.cumsum(cap)
        if not len(cand) or cum[-1] < len(idx):
            cl._undo(taken)
            return None
        last = int(np.searchsorted(cum, len(idx)))
        nodes, k = cand[: last + 1], cap[: last + 1].copy()
        k[-1] -= int(cum[last]) - len(idx)
        cl._change(nodes, -c * k, -m * k)
        taken.append((nodes, c, m, k))
        for i, j in zip(idx, np.repeat(nodes, k).tolist(), strict=True):
            where[i] = j
        start = int(nodes[-1])
    cl._start = start
    cl.free_cpu_total -= tc
    cl.free_mem_total -= tm
    return where


def _cluster_state(cl: Cluster):
    return (cl.free_cpu.tolist(), cl.free_mem.tolist(), cl.free_cpu_total, cl.free_mem_total, cl._start,
            cl._hc.tolist(), cl._hm.tolist(), cl.version)


@pytest.mark.parametrize("seed,nodes,bound", [(0, 8, True), (1, 300, True), (2, 600, True), (3, 50, False)])
def test_place_of_one_shape_equals_the_reference(seed, nodes, bound):
    rng = random.Random(seed)
    fast, ref = Cluster(ClusterSpec(nodes=nodes), bound=bound), Cluster(ClusterSpec(nodes=nodes), bound=bound)
    shapes = [(c, m * GiB) for c in (0.5, 1.0, 3.3, 8.0, 31.0) for m in (0.7, 2.5, 8.0, 30.0, 1.1)]
    placed: list = []
    started = 0
    for _ in range(1500):
        if placed and rng.random() < 0.4:
            pods, where = placed.pop(rng.randrange(len(placed)))
            fast.release(pods, where)
            ref.release(pods, where)
        else:
            pods = [rng.choice(shapes)] * rng.choice([1, 2, 3, 5, 8, 16, 40, 200])
            w_fast, w_ref = fast.place(pods), _place_reference(ref, pods)
            assert w_fast == w_ref
            if w_fast is not None:
                placed.append((pods, w_fast))
                started += 1
        assert _cluster_state(fast) == _cluster_state(ref)
    assert started > 50
