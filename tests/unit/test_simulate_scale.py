"""The simulator's speed-ups (issue 17: 100,000 jobs) keep its results.

The contract (docs/performance.md, "### Scale"): the model-driven policies' predictions are batched / evaluated row
by row / cached, which is not bit-identical to the per-row matrix arithmetic they replaced (agreement to rtol 1e-9
is tested in tests/unit/test_throughput_predict_paths.py and, for Optimus's convergence fit, below). A decision at
an exact tie can therefore flip, so this replay checks two things on one trace: TraceParams(shape="torchrec",
n_jobs=120, arrival_window_h=72), seed 0, ClusterSpec(nodes=12), SimParams(eviction_per_node_h=the trace's).

1. `EXPECTED`: counts, failures, a hash of every job's final status and of the decision counts (`_fingerprint`)
   exactly, and the metrics to 1e-9, as the current code produces them (re-recorded after the batched / cached
   predictions went in, 2026-12-02; they equal the values the code before any speed-up produced, commit 52efff1:
   on this trace no decision flipped). A change here means the code's decisions changed: re-record only for an
   intended change, and say why in the commit.
2. `BEFORE_SPEEDUPS`: the summary metrics the code before the speed-ups produced (commit 52efff1, from a
   `git worktree`; for DLRover-RM, whose decisions were changed on purpose since, the first recording of the
   changed policy), which the current results must stay within `SUMMARY_TOLERANCE` of: one job's share of the
   completion rate (1/120), 2% of the median JCT, 0.5 points of CPU and memory utilization. That is what one
   decision flipped by rounding can move on 120 jobs, and 0.5 points is the stability asked of the policies'
   gains over static (bench/results/simulate.json); a drift past it is a behaviour change, not rounding.
"""
from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest

from recforge.elastic.optimizer.models.history import InMemoryHistory, JobRecord
from recforge.elastic.optimizer.models.throughput_model import Allocation, OnlineThroughputModel, Sample
from recforge.elastic.simulate import ClusterSpec, SimParams, TraceParams, generate_trace, make_policy
from recforge.elastic.simulate.engine import Simulation
from recforge.elastic.simulate.policies import fit_convergence

EXPECTED = {
    "static": {"completed": 86, "events": 4215, "plan_changes": 0, "decisions": 0,
               "failures": {"pending too long (user gave up)": 31, "out of memory": 3},
               "jct_median_h": 3.0613573917615646, "jct_mean_h": 3.725121508991972,
               "cpu_utilization": 0.5190279432872075, "memory_utilization": 0.5086793826703098,
               "statuses": "aa70f07c069fbc46", "decisions_sha": "44136fa355b3678a"},
    "optimus": {"completed": 92, "events": 5045, "plan_changes": 493, "decisions": 0,
                "failures": {"pending too long (user gave up)": 24, "out of memory": 4},
                "jct_median_h": 2.9132032916955843, "jct_mean_h": 3.710054380175967,
                "cpu_utilization": 0.5445568926866672, "memory_utilization": 0.5384096576889973,
                "statuses": "581a6c288b797b0c", "decisions_sha": "44136fa355b3678a"},
    # re-recorded for the sixth session's policy changes (right-sizing to the rule's fixed point, peaks converted to
    # the worker count, memory from the measured growth: docs/performance.md "### Sixth session"), 2026-12-02
    "dlrover": {"completed": 119, "events": 3290, "plan_changes": 278, "decisions": 1364,
                "failures": {"pending too long (user gave up)": 1},
                "jct_median_h": 1.6159188787001586, "jct_mean_h": 2.2240021140089996,
                "cpu_utilization": 0.6823070629856681, "memory_utilization": 0.6975777600084694,
                "statuses": "c67fb53d240c3256", "decisions_sha": "2f4d2611158a6c9f"},
}


# The code before the speed-ups (commit 52efff1) on the same trace: completion rate, median JCT, CPU / memory util.
BEFORE_SPEEDUPS = {
    "static": (86 / 120, 3.0613573917615646, 0.5190279432872075, 0.5086793826703098),
    "optimus": (92 / 120, 2.9132032916955843, 0.5445568926866672, 0.5384096576889973),
    # DLRover-RM's decisions changed on purpose after the speed-ups (sixth session): its reference is the first
    # recording of the changed policy (EXPECTED below), which later speed-ups must stay within the tolerance of.
    # (Before the change, on this trace: 115 / 120, 2.5745 h, CPU 0.6512, memory 0.6056.)
    "dlrover": (119 / 120, 1.6159188787001586, 0.6823070629856681, 0.6975777600084694),
}
SUMMARY_TOLERANCE = {"completion_rate": ("abs", 1 / 120), "jct_median_h": ("rel", 0.02),
                     "cpu_utilization": ("abs", 0.005), "memory_utilization": ("abs", 0.005)}


def _fingerprint(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def trace():
    tp = TraceParams(shape="torchrec", n_jobs=120, arrival_window_h=72.0)
    return tp, generate_trace(tp, seed=0)


@pytest.fixture(scope="module")
def runs(trace):
    tp, jobs = trace
    out = {}
    for policy in sorted(EXPECTED):
        sim = Simulation(jobs, make_policy(policy), ClusterSpec(nodes=12),
                         SimParams(eviction_per_node_h=tp.eviction_per_node_h), 0)
        out[policy] = (sim, sim.run())
    return out


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_replay_gives_the_recorded_decisions(runs, policy):
    sim, r = runs[policy]
    want = EXPECTED[policy]
    got = {"completed": r["completed"], "events": sim.events, "plan_changes": r["plan_changes"],
           "decisions": sum(r["decisions"].values()), "failures": r["failures"],
           "statuses": _fingerprint([(p["job"], p["status"]) for p in r["per_job"]]),
           "decisions_sha": _fingerprint(r["decisions"])}
    assert got == {k: want[k] for k in got}
    for k in ("jct_median_h", "jct_mean_h", "cpu_utilization", "memory_utilization"):
        assert r[k] == pytest.approx(want[k], rel=1e-9, abs=0), k


@pytest.mark.parametrize("policy", sorted(BEFORE_SPEEDUPS))
def test_summary_within_tolerance_of_the_code_before_the_speedups(runs, policy):
    _, r = runs[policy]
    for (k, (kind, tol)), old in zip(SUMMARY_TOLERANCE.items(), BEFORE_SPEEDUPS[policy], strict=True):
        allowed = tol * abs(old) if kind == "rel" else tol
        assert abs(r[k] - old) <= allowed, f"{policy} {k}: {r[k]} vs {old} before the speed-ups (allowed {allowed})"


def _fit_convergence_reference(k, loss, grid=32):
    """Optimus's convergence fit as it was written before the speed-ups (np.linspace, means, ** 2)."""
    k, loss = np.asarray(k, float), np.asarray(loss, float)
    if len(k) < 3 or np.ptp(k) <= 0:
        return None
    b2s = np.linspace(0.0, float(loss.min()) * 0.995, grid)
    y = 1.0 / (loss[None, :] - b2s[:, None])
    km, ym = k.mean(), y.mean(axis=1)
    b0 = np.maximum(((k - km)[None, :] * (y - ym[:, None])).sum(axis=1) / ((k - km) ** 2).sum(), 0.0)
    b1 = np.maximum(ym - b0 * km, 1e-9)
    err = ((1.0 / (b0[:, None] * k[None, :] + b1[:, None]) + b2s[:, None] - loss[None, :]) ** 2).sum(axis=1)
    i = int(np.argmin(err))
    if b0[i] <= 0:
        return None
    return float(b0[i]), float(b1[i]), float(b2s[i])


def test_fit_convergence_equals_the_reference():
    rng = np.random.default_rng(0)
    for trial in range(1500):
        n = int(rng.integers(3, 31))
        k = np.sort(rng.random(n) * rng.integers(1, 100))
        b0, b1, b2 = rng.random(3) * [2, 1, 0.5] + [0.01, 0.1, 0.05]
        loss = (1 / (b0 * k + b1) + b2) * (1 + 0.01 * rng.standard_normal(n))
        if trial % 50 == 0:
            loss = loss[::-1].copy()  # rising loss: no decreasing fit
        for grid in (32, 2, 100):
            got, ref = fit_convergence(k, loss, grid), _fit_convergence_reference(k, loss, grid)
            assert (got is None) == (ref is None)
            if ref is not None:
                np.testing.assert_allclose(got, ref, rtol=1e-9, atol=0)
    assert fit_convergence(np.array([1.0, 1.0, 1.0]), np.array([3.0, 2.0, 1.0])) is None  # no spread in k
    assert fit_convergence(np.array([1.0, 2.0]), np.array([3.0, 2.0])) is None  # fewer than 3 points


def _similar_by_scan(records, dataset, family, limit):
    same = [r for r in records if r.dataset == dataset and r.model_family == family]
    same.sort(key=lambda r: r.finished_at, reverse=True)
    return same[:limit]


@pytest.mark.parametrize("ordered", [True, False])
def test_history_index_returns_what_a_scan_returns(ordered):
    """The per-key index (newest from the tail) gives the records and order of a sort over all, ties included."""
    rnd = random.Random(3)
    h = InMemoryHistory()
    t = 0.0
    for i in range(400):
        t = t + rnd.choice([0.0, 0.0, 1.0, 2.5]) if ordered else rnd.choice([0.0, 1.0, 2.0, 3.0])
        h.add(JobRecord(dataset=rnd.choice("ab"), model_family=rnd.choice("xy"), final_plan={"i": i}, finished_at=t))
        if i % 7 == 0:
            for key in (("a", "x"), ("b", "y"), ("c", "x")):
                for limit in (0, 1, 5, 20):
                    got = h.similar(*key, limit=limit)
                    assert got == _similar_by_scan(h.records, *key, limit), (i, key, limit)
    h.records.pop(0)  # changed from outside: the index is rebuilt
    assert h.similar("a", "x", 500) == _similar_by_scan(h.records, "a", "x", 500)


def test_online_model_counts_configurations_incrementally():
    m = OnlineThroughputModel(("const", "b_per_cpu", "log_w"), max_samples=10)
    rnd = random.Random(1)
    for _ in range(60):
        a = Allocation(rnd.randint(1, 4), float(rnd.randint(1, 3)), 512)
        m.add(Sample(a, 100.0 + rnd.random()), refit=False)
        brute = len({(s.allocation.workers, s.allocation.cpu_per_worker) for s in m.samples})
        assert m.distinct_configs == brute
    m.samples = m.samples[:2]  # replaced from outside: counted again
    assert m.distinct_configs == len({(s.allocation.workers, s.allocation.cpu_per_worker) for s in m.samples})
