"""The simulator's speed-ups (issue 17: 100,000 jobs) change no decision.

The expected values below were produced by the committed code before the speed-ups (commit 52efff1, checked out
with `git worktree add /tmp/h7_base HEAD`), running the same trace: TraceParams(shape="torchrec", n_jobs=120,
arrival_window_h=72), seed 0, ClusterSpec(nodes=12), SimParams(eviction_per_node_h=the trace's), and hashing each
job's final status and the decision counts with `_fingerprint` below. Counts and statuses must match exactly; the
metrics to 1e-9 (the same arithmetic gives the same floats here; the tolerance only spares other BLAS builds).
"""
from __future__ import annotations

import hashlib
import json
import random

import pytest

from recforge.elastic.optimizer.models.history import InMemoryHistory, JobRecord
from recforge.elastic.optimizer.models.throughput_model import Allocation, OnlineThroughputModel, Sample
from recforge.elastic.simulate import ClusterSpec, SimParams, TraceParams, generate_trace, make_policy
from recforge.elastic.simulate.engine import Simulation

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
    "dlrover": {"completed": 115, "events": 4336, "plan_changes": 468, "decisions": 2340,
                "failures": {"pending too long (user gave up)": 5},
                "jct_median_h": 2.5745060722600144, "jct_mean_h": 3.3077119412379274,
                "cpu_utilization": 0.651196977317257, "memory_utilization": 0.605620226983975,
                "statuses": "3579d537dcea5fb7", "decisions_sha": "d485feb9c875ec95"},
}


def _fingerprint(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def trace():
    tp = TraceParams(shape="torchrec", n_jobs=120, arrival_window_h=72.0)
    return tp, generate_trace(tp, seed=0)


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_same_results_as_before_the_speedups(trace, policy):
    tp, jobs = trace
    sim = Simulation(jobs, make_policy(policy), ClusterSpec(nodes=12),
                     SimParams(eviction_per_node_h=tp.eviction_per_node_h), 0)
    r = sim.run()
    want = EXPECTED[policy]
    got = {"completed": r["completed"], "events": sim.events, "plan_changes": r["plan_changes"],
           "decisions": sum(r["decisions"].values()), "failures": r["failures"],
           "statuses": _fingerprint([(p["job"], p["status"]) for p in r["per_job"]]),
           "decisions_sha": _fingerprint(r["decisions"])}
    assert got == {k: want[k] for k in got}
    for k in ("jct_median_h", "jct_mean_h", "cpu_utilization", "memory_utilization"):
        assert r[k] == pytest.approx(want[k], rel=1e-9, abs=0), k


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
