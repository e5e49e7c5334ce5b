"""The fifth session's simulator speed-ups (issue 17) against their simple references: each fast path gives the same
values, bit for bit (the decisions of a 1k / 10k run were checked equal by hashing every job's result and every
decision event; tests/unit/test_simulate_scale.py replays 120 jobs per policy)."""
from __future__ import annotations

import bisect
import dataclasses
import random

import numpy as np
import pytest
from scipy.optimize import nnls

from recforge.elastic.optimizer import InstabilityStage, JobDescription, JobLimits, Observation, PodPlan
from recforge.elastic.optimizer.instability_stage import _median_sorted
from recforge.elastic.optimizer.models.memory_model import GiB, MemoryTrend, _shard_bytes, _shard_bytes_reference
from recforge.elastic.optimizer.models.throughput_model import (
    PS_TERMS,
    Allocation,
    ModelFitError,
    OnlineThroughputModel,
    Sample,
    ThroughputModel,
    fit,
    solve_nnls,
)
from recforge.elastic.optimizer.search import _plan, _with


def test_shard_bytes_heap_equals_the_scan():
    rng = random.Random(0)
    for _ in range(3000):
        n, w = rng.randint(0, 50), rng.randint(1, 70)
        # ties on purpose: equal tables make equal loads, where the lowest index must win
        tables = tuple(rng.choice([rng.random() * 1e9, float(rng.randint(1, 4)) * 1e8]) for _ in range(n))
        assert _shard_bytes.__wrapped__(tables, w) == _shard_bytes_reference(tables, w)


def test_solve_nnls_equals_scipy_and_refuses_bad_points():
    rng = np.random.default_rng(1)
    for _ in range(500):
        k = int(rng.integers(1, 7))
        n = int(rng.integers(1, 210))
        a = rng.random((n + k, k)) * rng.lognormal(0, 3, size=k)
        b = rng.random(n + k) - 0.3
        x = solve_nnls(a, b, "t", maxiter=50 * k)
        assert np.array_equal(x, nnls(a, b, maxiter=50 * k)[0])
        assert np.array_equal(solve_nnls(a[:, ::-1], b, "t"), nnls(a[:, ::-1], b)[0])  # (a strided view: public path)
    a = np.ones((3, 2))
    a[1, 1] = np.nan
    with pytest.raises(ModelFitError, match="refused"):
        solve_nnls(a, np.ones(3), "bad")


def _samples(rng, n, terms):
    out = []
    for _ in range(n):
        w, c = int(rng.integers(1, 30)), float(rng.integers(1, 12))
        sv = int(rng.integers(0, 3)) if terms == PS_TERMS else 0
        out.append(Sample(Allocation(w, c, 512, sv, 2.0 if sv else 0.0), float(rng.lognormal(8, 1)),
                          float(rng.choice([1.0, 1.0, 2.0]))))
    return out


@pytest.mark.parametrize("terms", [("const", "b_per_cpu", "log_w"), PS_TERMS])
def test_online_refit_on_kept_columns_equals_fit(terms):
    """The online model's refit reads its kept column array; `fit` on its samples builds the columns anew."""
    rng = np.random.default_rng(2)
    prior = ThroughputModel(terms, tuple(float(x) for x in rng.random(len(terms)) * 0.01))
    fitted = 0
    for _ in range(40):
        m = OnlineThroughputModel(terms, prior, min_points=3, max_samples=int(rng.integers(5, 40)))
        for s in _samples(rng, int(rng.integers(3, 90)), terms):
            m.add(s, refit=False)
            if rng.random() < 0.05:  # the list changed from outside: the columns are rebuilt
                m.samples = m.samples[1:] if rng.random() < 0.5 else list(m.samples)
            if rng.random() < 0.3 and m.distinct_configs >= 3:
                m.refit()
                ref = fit(m.samples, terms, prior=prior, prior_strength=m.prior_strength)
                assert m.model is not None
                assert m.model.coef == ref.coef and repr(m.model.fit_mape) == repr(ref.fit_mape)
                fitted += 1
    assert fitted > 100
    m = OnlineThroughputModel(terms, prior, min_points=1)
    for s in _samples(rng, 5, terms):
        m.add(s, refit=False)
    m.samples = [*m.samples, Sample(m.samples[0].allocation, float("nan"))]  # a bad point from outside
    with pytest.raises(ModelFitError, match="finite and > 0"):
        m.refit()


def _stage_reference(stage: InstabilityStage) -> InstabilityStage:
    """The same stage with the former trend bookkeeping: one MemoryTrend per pod, each added to."""

    def add_points(group, step, rss_list):
        for i, rss in enumerate(rss_list):
            stage.trends.setdefault((group, i), MemoryTrend()).add(step, rss)

    stage._add_points = add_points  # type: ignore[method-assign]
    return stage


def test_shared_memory_trends_and_straggler_verdicts_give_the_same_events():
    rng = random.Random(3)
    job = JobDescription("d", "f", PodPlan(4, 4.0, 8 * GiB), total_samples=1e9, table_bytes=(1e8, 2e8))
    limits = JobLimits(cpu=64, memory=512 * GiB)
    changed = 0
    for _ in range(60):
        fast, ref = InstabilityStage(job, limits), _stage_reference(InstabilityStage(job, limits))
        workers, step, rss = rng.randint(1, 8), 0, 2 * GiB
        for _ in range(rng.randint(5, 60)):
            if rng.random() < 0.1:
                workers = rng.randint(1, 8)  # a new shape: the trends start over
            step += rng.randint(1, 10_000)
            rss += rng.choice([0.0, 1e6, 5e7, -1e6])
            n = min(workers, rng.choice([4, 4, 4, 2, 6]))
            mem = [rss] * n if rng.random() < 0.7 else [rss + rng.choice([0.0, 1e8]) for _ in range(n)]
            st = [1.0] * n if rng.random() < 0.6 else [rng.choice([1.0, 1.0, 2.5, 0.0, -1.0]) for _ in range(n)]
            plan = PodPlan(workers, 4.0, rng.choice([4 * GiB, 8 * GiB, 3 * GiB]))
            obs = Observation(time_s=float(step), plan=plan, samples_per_s=100.0, step=step, worker_step_s=st,
                              worker_memory=mem, total_steps=2e6, oom_workers=[0] if rng.random() < 0.03 else [])
            a, b = fast.observe(obs), ref.observe(obs)
            assert [(e.action, e.reason, e.plan_after) for e in a] == [(e.action, e.reason, e.plan_after) for e in b]
            changed += any(e.changes_plan for e in a)
            assert fast.trends.keys() == ref.trends.keys()
            assert all(fast.trends[k].points == ref.trends[k].points for k in ref.trends)
    assert changed > 0


def test_straggler_verdict_equals_the_median_of_the_others():
    rng = random.Random(4)
    for _ in range(2000):
        times = [rng.choice([1.0, 1.0, 2.0, 3.0, 0.5, 0.0]) for _ in range(rng.randint(2, 8))]
        pos = sorted(t for t in times if t and t > 0)
        if len(pos) < 2:
            continue
        med = _median_sorted(pos, len(pos))
        want = [i for i, t in enumerate(times) if t and t > 2.0 * (_median_sorted(pos, bisect.bisect_left(pos, t))
                                                                       if t > 0 else med)]
        plan = PodPlan(len(times), 4.0, 8 * GiB)
        stage = InstabilityStage(JobDescription("d", "f", plan), JobLimits(cpu=64, memory=512 * GiB))
        ev = [e for e in stage.observe(Observation(time_s=0.0, plan=plan, worker_step_s=times))
              if e.action == "replace_straggler"]
        assert (f"worker(s) {want} step time" in ev[0].reason) if want else not ev


def test_memory_trend_copy_is_independent():
    tr = MemoryTrend(window=3)
    for i in range(5):
        tr.add(i, 10.0 * i)
    c = tr.copy()
    assert c.points == tr.points and c.slope() == tr.slope()
    c.add(9, 0.0)
    assert tr.points == [(2.0, 20.0), (3.0, 30.0), (4.0, 40.0)]


def test_search_plans_equal_podplan():
    p = _plan(2, 3.0, 5e9, 512, 1, 2.0, 1e9)
    q = PodPlan(2, 3.0, 5e9, 512, 1, 2.0, 1e9)
    assert p == q and hash(p) == hash(q) and repr(p) == repr(q) and p.to_dict() == q.to_dict()
    assert _with(q, workers=5) == dataclasses.replace(q, workers=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.workers = 3
    for bad in ((0, 1.0, 1.0), (1, 0.0, 1.0), (1, 1.0, 0.0)):
        with pytest.raises(ValueError, match="PodPlan needs"):
            _plan(*bad, 512, 0, 0.0, 0.0)
