"""The fast prediction paths of the throughput model agree with the per-row design-matrix reference.

Since issue 17 (100,000 simulated jobs) `ThroughputModel.predict` evaluates up to `ROW_PATH_MAX` allocations row
by row in Python, the search scores its candidate plans from plain tuples, `fit` builds the columns once (from rows
the online model keeps), and the online model's prior-scaled refit caches the prior's prediction per sample. None
of these is bit-identical to the matrix product (summation order, log2); the contract is rtol 1e-9.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from recforge.elastic.optimizer.models.memory_model import MemoryTrend, embedding_shard_bytes
from recforge.elastic.optimizer.models.throughput_model import (
    ROW_PATH_MAX,
    TERMS,
    Allocation,
    OnlineThroughputModel,
    Sample,
    ThroughputModel,
    fit,
    mape,
    row_values,
)
from recforge.elastic.optimizer.plans import JobDescription, JobLimits, OptimizerConfig, PodPlan
from recforge.elastic.optimizer.search import best_moves, plan_cost

RTOL = 1e-9


def _alloc(rnd: random.Random) -> Allocation:
    ps = rnd.random() < 0.5
    return Allocation(rnd.randint(1, 64), float(rnd.randint(1, 32)), rnd.choice([64, 512, 4096]),
                      servers=rnd.randint(1, 15) if ps else 0, cpu_per_server=float(rnd.randint(1, 16)) if ps else 0.0,
                      host_cores=rnd.choice([None, 2.0, 16.0]))


def _model(rnd: random.Random) -> ThroughputModel:
    terms = tuple(rnd.sample(sorted(TERMS), rnd.randint(1, 6)))
    return ThroughputModel(terms, tuple(rnd.choice([0.0, rnd.random() * 10 ** rnd.randint(-6, -1)]) for _ in terms))


@pytest.mark.parametrize("n", [0, 1, 2, 5, ROW_PATH_MAX, ROW_PATH_MAX + 1, 200])
def test_predict_equals_the_matrix_reference(n):
    rnd = random.Random(n)
    for _ in range(200):
        m = _model(rnd)
        allocs = [_alloc(rnd) for _ in range(n)]
        got, ref = m.predict(allocs), m.predict_matrix(allocs)
        assert isinstance(got, np.ndarray) and got.shape == ref.shape == (n,)
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=0)
        np.testing.assert_allclose(m.predict_rows([row_values(a) for a in allocs]), ref, rtol=RTOL, atol=0)


def test_predict_single_allocation_and_ties():
    rnd = random.Random(7)
    for _ in range(500):
        m, a = _model(rnd), _alloc(rnd)
        one = m.predict(a)
        assert isinstance(one, float)
        assert one == pytest.approx(float(m.predict_matrix([a])[0]), rel=RTOL, abs=0)
        tied = m.predict([a, a, a])  # the same allocation three times: the same value three times
        assert tied[0] == tied[1] == tied[2] == one


def test_predict_degenerate_rows_floor_the_step_time():
    m = ThroughputModel(("const",), (0.0,))  # zero step time: floored at 1e-12 on both paths
    a = Allocation(2, 1.0, 512)
    assert m.predict(a) == pytest.approx(float(m.predict_matrix([a])[0]), rel=RTOL) == 2 * 512 / 1e-12


def test_fit_from_kept_rows_equals_fit_from_allocations():
    rnd = random.Random(3)
    truth = ThroughputModel(("const", "b_per_cpu", "log_w"), (0.05, 2e-4, 0.03))
    samples = [Sample(a, truth.predict(a) * (1 + 0.02 * rnd.random()))
               for a in (Allocation(rnd.randint(1, 20), float(rnd.randint(1, 8)), 512) for _ in range(150))]
    prior = ThroughputModel(truth.terms, (0.03, 1.5e-3, 0.04))
    for kw in ({}, {"prior": prior, "prior_strength": 0.3}):
        a = fit(samples, truth.terms, **kw)
        b = fit(samples, truth.terms, rows=[row_values(s.allocation) for s in samples], **kw)
        assert a.coef == b.coef and a.fit_mape == b.fit_mape
        ref_mape = mape(a.predict_matrix([s.allocation for s in samples]), [s.samples_per_s for s in samples])
        assert a.fit_mape == pytest.approx(ref_mape, rel=RTOL)
    with pytest.raises(ValueError, match="rows for"):
        fit(samples, truth.terms, rows=[])


def _prior_scaled_reference(prior: ThroughputModel, samples: list[Sample]) -> tuple[tuple[float, ...], float]:
    obs = np.array([s.samples_per_s for s in samples])
    pred = prior.predict_matrix([s.allocation for s in samples])
    k = float(np.median(pred / obs))
    return tuple(c * k for c in prior.coef), mape(pred / k, obs)


def test_prior_scaled_refit_with_cached_predictions_equals_the_reference():
    rnd = random.Random(5)
    prior = ThroughputModel(("const", "b_per_cpu", "log_w"), (0.03, 1.5e-3, 0.04))
    m = OnlineThroughputModel(prior.terms, prior, min_points=3, max_samples=25)
    plans = [Allocation(4, 2.0, 512), Allocation(5, 2.0, 512)]  # two configurations: the prior-scaled path
    for i in range(80):
        m.add(Sample(rnd.choice(plans), 900 + 200 * rnd.random()), refit=False)
        if i % 3 == 0:
            assert m.refit() and m.model is not None and m.model.meta["source"] == "prior scaled"
            coef, err = _prior_scaled_reference(prior, m.samples)
            np.testing.assert_allclose(m.model.coef, coef, rtol=RTOL, atol=0)
            assert m.model.fit_mape == pytest.approx(err, rel=RTOL)
    m.samples = m.samples[5:]  # changed from outside: the cache is rebuilt
    m.refit()
    np.testing.assert_allclose(m.model.coef, _prior_scaled_reference(prior, m.samples)[0], rtol=RTOL, atol=0)
    m.samples.append(Sample(plans[0], 1000.0))  # appended from outside
    m.refit()
    np.testing.assert_allclose(m.model.coef, _prior_scaled_reference(prior, m.samples)[0], rtol=RTOL, atol=0)


def test_online_fit_uses_rows_in_step_with_the_samples():
    rnd = random.Random(9)
    m = OnlineThroughputModel(("const", "b_per_cpu", "log_w"), None, min_points=3, max_samples=30)
    for _ in range(70):
        a = Allocation(rnd.randint(1, 6), float(rnd.randint(1, 4)), 512)
        m.add(Sample(a, 100.0 * a.workers / (0.01 + 0.001 * 512 / a.cpu_per_worker) * (1 + 0.01 * rnd.random())))
        if m.distinct_configs < 3:
            assert m.model is None  # no prior, too few configurations
            continue
        assert m.model is not None
        ref = fit(m.samples, m.terms)
        assert m.model.coef == ref.coef


def _best_moves_reference(plan, model, limits, cfg, job):
    """The search's scoring as it was: Allocations through the matrix path."""
    from recforge.elastic.optimizer.search import candidates
    cands = [(g, a, p) for g in (True, False) for a, p in candidates(plan, g, job.parameter_server)
             if not g or limits.fits(p)]
    thr = model.predict_matrix([plan.allocation()] + [p.allocation() for _, _, p in cands])
    out = {}
    for (_, a, p), t in zip(cands, thr[1:], strict=True):
        out[a] = (float(t) - float(thr[0]), plan_cost(p, cfg) - plan_cost(plan, cfg))
    return out


def test_best_moves_scores_equal_the_matrix_reference():
    rnd = random.Random(11)
    cfg = OptimizerConfig()
    limits = JobLimits(cpu=400.0, memory=4e12)
    for _ in range(300):
        ps = rnd.random() < 0.5
        plan = PodPlan(rnd.randint(1, 20), float(rnd.randint(1, 16)), 8e9, 512, rnd.randint(1, 6) if ps else 0,
                       float(rnd.randint(1, 8)) if ps else 0.0, 8e9 if ps else 0.0)
        job = JobDescription(dataset="d", model_family="f", requested=plan, total_samples=1e8, parameter_server=ps)
        model = ThroughputModel(("const", "b_per_cpu", "log_w", "ps_load", "ps_fanin", "w"),
                                tuple(rnd.random() * 10 ** rnd.randint(-5, -2) for _ in range(6)))
        grow, shrink = best_moves(plan, model, limits, cfg, job)
        ref = _best_moves_reference(plan, model, limits, cfg, job)
        for mv in (grow, shrink):
            if mv is not None:
                gain, cost = ref[mv.action]
                assert mv.gain == pytest.approx(gain, rel=RTOL, abs=1e-9 * abs(model.predict(plan.allocation())))
                assert mv.cost == cost


def test_memory_trend_slope_equals_the_generator_sums():
    rnd = random.Random(2)
    tr = MemoryTrend(window=20)
    for i in range(60):
        tr.add(i * 10.0 + rnd.choice([0.0, 0.5]), 1e9 + 1e6 * i + 1e5 * rnd.random())
        p = tr.points
        n = len(p)
        if n < 3:
            assert tr.slope() == 0.0
            continue
        ms, mr = sum(x[0] for x in p) / n, sum(x[1] for x in p) / n
        ref = sum((x[0] - ms) * (x[1] - mr) for x in p) / sum((x[0] - ms) ** 2 for x in p)
        assert tr.slope() == ref
    tr.points = tr.points[:4] + [(1e4, 3e9)]  # replaced from outside: the kept lists are rebuilt
    p = tr.points
    ms, mr = sum(x[0] for x in p) / 5, sum(x[1] for x in p) / 5
    assert tr.slope() == sum((x[0] - ms) * (x[1] - mr) for x in p) / sum((x[0] - ms) ** 2 for x in p)
    flat = MemoryTrend()
    for _ in range(5):
        flat.add(7.0, 1e9)  # one step repeated: no slope
    assert flat.slope() == 0.0


def _shard_by_scan(tables, workers):
    load = [0.0] * workers
    for b in sorted(tables, reverse=True):
        i = min(range(workers), key=load.__getitem__)
        load[i] += b
    return max(load)


def test_embedding_shard_bytes_cache_equals_the_placement():
    rnd = random.Random(4)
    for _ in range(300):
        tables = [float(rnd.randint(1, 50)) * 1e8 for _ in range(rnd.randint(0, 30))] or [1e9]
        w = rnd.randint(1, 40)
        for arg in (tables, tuple(tables)):  # a list and a tuple: the same cached value
            assert embedding_shard_bytes(arg, w) == _shard_by_scan(tables, w)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        embedding_shard_bytes([1e9], 0)
