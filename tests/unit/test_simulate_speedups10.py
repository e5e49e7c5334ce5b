"""The tenth simulator speed-ups (issue 17, deliverable 4b: Optimus at 100,000 jobs) against their references, bit for
bit: the bucket bound per pod size from each size's per-bucket counts kept as integers (`cluster._Bound`: one integer
dot product per size and cluster version instead of four numpy calls), and an Optimus round's prior-scaled
throughput-model refits together (`throughput_model._rescale_batch`) against each model's own `refit`."""
from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest

from recforge.elastic.optimizer.models import throughput_model as tm
from recforge.elastic.optimizer.models.throughput_model import (
    Allocation,
    ModelFitError,
    OnlineThroughputModel,
    Sample,
    ThroughputModel,
    refit_many,
)
from recforge.elastic.simulate import cluster as cluster_mod
from recforge.elastic.simulate.cluster import Cluster, ClusterSpec, GiB
from recforge.elastic.simulate.policies import GENERIC_TR_PRIOR, TR_TERMS
from test_simulate_speedups9 import _random_model, _reference, _same, _state


def _bound_reference(cl: Cluster, c: float, m: float) -> float:
    """The committed `fit_limit`: the histograms built again from the nodes' free capacity (`_bc` / `_bm`, as
    `Cluster.__init__` builds them), then one numpy evaluation per resource."""
    if not cl.bound:
        return math.inf
    hc = np.bincount(cl._bc(cl.free_cpu), minlength=cl._kc)
    hm = np.bincount(cl._bm(cl.free_mem), minlength=cl._km)
    lim: float = math.inf
    if c > 0:
        lim = int(hc @ np.floor(cl._vc / c))
    if m > 0:
        lim = min(lim, int(hm @ np.floor(cl._vm / m)))
    return lim


SIZES = [(c, m) for c in (0.0, 0.5, 1.0, 2.0, 3.3, 8.0, 16.0, 31.9) for m in (0.0, 0.7, 1.0, 2.5, 8.0, 30.0, 127.5)]


def _walk(cl: Cluster, rng: random.Random, steps: int, sizes, check) -> int:
    """Random placements (1-40 pods: a few nodes and many), releases and resizes taken back, asking the bound of
    random sizes after each step and `check`ing it; the number of checks."""
    placed: list = []
    checked = 0
    shapes = [(c, m * GiB) for c in (0.5, 1.0, 2.0, 3.3, 8.0) for m in (0.7, 2.5, 8.0, 30.0, 1.1)]
    for _ in range(steps):
        u = rng.random()
        if placed and u < 0.35:
            pods, where = placed.pop(rng.randrange(len(placed)))
            cl.release(pods, where)
        elif placed and u < 0.45:
            pods, where = placed[rng.randrange(len(placed))]
            cl.release(pods, where)
            cl.take(pods, where)
        else:
            pods = [rng.choice(shapes)] * rng.choice([1, 2, 3, 5, 8, 16, 40])
            if rng.random() < 0.2:  # a PS job: two shapes
                pods = pods + [rng.choice(shapes)] * rng.randint(1, 4)
            where = cl.place(pods)
            if where is not None:
                placed.append((pods, where))
        for _ in range(rng.randint(0, 8)):  # (some sizes go unasked for many steps: their counts fall behind)
            check(*rng.choice(sizes))
            checked += 1
    return checked


@pytest.mark.parametrize("seed,nodes,cache_max", [(0, 30, 1 << 14), (1, 300, 1 << 14), (2, 40, 3), (3, 6, 7)])
def test_fit_limit_equals_the_numpy_bound_through_placements(monkeypatch, seed, nodes, cache_max):
    """Through random placements, releases and resizes taken back, on few nodes and many (the sizes forgotten often
    with a small cache): `fit_limit` equals the committed evaluation on histograms built again from the nodes."""
    monkeypatch.setattr(cluster_mod, "_CACHE_MAX", cache_max)
    cl = Cluster(ClusterSpec(nodes=nodes, cpu_per_node=32.0, memory_per_node=128 * GiB))
    rng = random.Random(seed)
    sizes = [(c, m * GiB) for c, m in SIZES]
    stats = {"kept": 0, "again": 0}

    def check(c, m):
        e = cl._limm.cache.get(m)
        stats["kept"] += e is not None
        stats["again"] += e is not None and e[1] != cl.version
        got = cl.fit_limit(c, m)
        assert got == _bound_reference(cl, c, m), (c, m)
        assert type(got) is (float if c <= 0 and m <= 0 else int)
    assert _walk(cl, rng, 600, sizes, check) > 1000
    assert stats["again"] > 100  # kept sizes evaluated again at a new version
    assert max(len(cl._limc.cache), len(cl._limm.cache)) <= cache_max


def _both(cl: Cluster, c: float, m: float):
    """(fit_limit, the reference), or the exception types each raised."""
    out = []
    for f in (cl.fit_limit, lambda c, m: _bound_reference(cl, c, m)):
        try:
            with np.errstate(all="ignore"):
                out.append(f(c, m))
        except (OverflowError, ValueError) as e:
            out.append(type(e))
    return out


def test_fit_limit_of_sizes_too_small_to_keep():
    """A size whose per-node counts would pass 2**53 in all is evaluated with numpy every time (not kept), as before;
    one whose counts are not finite raises what the committed evaluation raised."""
    cl = Cluster(ClusterSpec(nodes=10, cpu_per_node=32.0, memory_per_node=128 * GiB))
    assert cl.place([(1.0, 3 * GiB)] * 5) is not None
    sizes = [(1e-15, 1e-6), (1e-12, 1.0), (1e-300, 1.0), (2.0, 1e-9), (5e-324, 5e-324), (1e-320, 1.0), (2.0, 1e-320)]
    first = [_both(cl, c, m) for c, m in sizes]
    assert all(a == b for a, b in first) and ValueError in {a for a, _ in first}
    assert 1e-15 not in cl._limc.cache and 1e-6 not in cl._limm.cache and {1e-12, 2.0} <= cl._limc.cache.keys()
    assert cl.place([(1.0, 3 * GiB)]) is not None
    assert all(a == b for a, b in (_both(cl, c, m) for c, m in sizes))


def test_fit_limit_without_the_bound_and_for_a_pod_of_nothing():
    cl = Cluster(ClusterSpec(nodes=10), bound=False)
    assert cl.fit_limit(1.0, GiB) == math.inf and not cl._limc.cache
    cl = Cluster(ClusterSpec(nodes=10))
    assert cl.fit_limit(0.0, 0.0) == math.inf
    assert cl.fit_limit(1.0, 0.0) == 10 * 32 and cl.fit_limit(0.0, GiB) == 10 * 128


def test_the_bound_follows_the_histograms_numpy_path():
    """The bound after an update through `_hist`'s numpy path (more nodes than `_FEW_NODES`) and back."""
    cl = Cluster(ClusterSpec(nodes=100, cpu_per_node=32.0, memory_per_node=128 * GiB))
    assert cl.fit_limit(4.0, 10 * GiB) == 100 * 8 == _bound_reference(cl, 4.0, 10 * GiB)
    where = cl.place([(30.0, 100 * GiB)] * 60)  # 60 nodes in one update
    assert where is not None and len(set(where)) == 60 > cluster_mod._FEW_NODES
    assert cl.fit_limit(4.0, 10 * GiB) == 40 * 8 == _bound_reference(cl, 4.0, 10 * GiB)
    cl.release([(30.0, 100 * GiB)] * 60, where)
    assert cl.fit_limit(4.0, 10 * GiB) == 100 * 8


# ---- the prior-scaled refits of an Optimus round together (`throughput_model._rescale_batch`) ---------------------
def _scaled_model(rate: float, prior: ThroughputModel = GENERIC_TR_PRIOR, n: int = 5) -> OnlineThroughputModel:
    m = OnlineThroughputModel(TR_TERMS, prior, min_points=3)
    for i in range(n):  # one or two configurations: fewer than min_points, so the refit scales the prior
        m.add(Sample(Allocation(2 + i % 2, 4.0, 512), rate * (1 + 0.01 * i)), refit=False)
    return m


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the extreme rates overflow, in `refit` too)
@pytest.mark.parametrize("seed", range(4))
def test_prior_scaled_refits_together_equal_each_refit(seed):
    """Random models (term sets, priors, min points, windows, weights, extreme rates), refitted three times with
    samples added between: `refit_many` leaves each as its own `refit` does, and the prior-scaled path ran."""
    rng = random.Random(100 + seed)
    models = [_random_model(rng) for _ in range(150)] + [_scaled_model(rng.uniform(100, 1e5)) for _ in range(30)]
    twins = copy.deepcopy(models)
    scaled = 0
    for rnd in range(3):
        scaled += sum(m._scalable() for m in models)
        got = refit_many(models)
        want = _reference(twins)
        for m, g, t, w in zip(models, got, twins, want, strict=True):
            assert _same(_state(m, g), _state(t, w)), (rnd, m.terms, m.prior, len(m.samples))
        state = random.Random(seed * 100 + rnd)
        for m, t in zip(models, twins, strict=True):
            for _ in range(state.choice([0, 1, 3])):
                s = Sample(Allocation(state.choice([1, 2, 2, 4]), 4.0, 512), state.uniform(500.0, 5e4))
                m.add(s, refit=False)
                t.add(s, refit=False)
    assert scaled > 100


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_prior_scaled_refits_out_of_range_or_failing(monkeypatch):
    """A scale beyond the normal floats sends every prior-scaled model of the call through its own `refit` (the
    batch takes none); a scaled prior that is not finite fails in the batch as in `refit` (ModelFitError, the model
    kept); samples replaced from outside are read again."""
    ones: list = []
    real = tm._refit_one
    monkeypatch.setattr(tm, "_refit_one", lambda m: ones.append(m) or real(m))
    cases = [
        [_scaled_model(2000.0), _scaled_model(1e-300), _scaled_model(3000.0)],  # k ~ 1e303: one by one
        [_scaled_model(2000.0), _scaled_model(1e-310, ThroughputModel(TR_TERMS, (1e305, 0.0, 0.0)))],  # coef * k: inf
        [_scaled_model(2000.0, n=1), _scaled_model(2500.0, n=2), _scaled_model(1e4, n=200)],
    ]
    outside = _scaled_model(4000.0)
    outside.samples = outside.samples[:2] + [Sample(Allocation(3, 4.0, 512), 7000.0)]  # (from outside)
    cases[2].append(outside)
    nan = _scaled_model(3000.0)
    nan.samples = nan.samples + [Sample(Allocation(2, 4.0, 512), math.nan)]  # (from outside: np.median's NaN)
    cases.append([_scaled_model(2000.0), nan])
    for models, one_by_one in zip(cases, (True, False, False, True), strict=True):
        twins = copy.deepcopy(models)
        ones.clear()
        got = refit_many(models)
        assert (len(ones) == len(models)) is one_by_one and all(m._scalable() for m in twins)
        want = _reference(twins)
        for m, g, t, w in zip(models, got, twins, want, strict=True):
            assert _same(_state(m, g), _state(t, w))
    assert got[0] is True and isinstance(got[1], ModelFitError)  # (the NaN case: np.median's NaN scale fails)
    twins = copy.deepcopy(cases[1])
    assert isinstance(_reference(twins)[1], ModelFitError)
