"""TorchRec-shaped simulator jobs, Optimus's own allocation, the engine's invariants and the size check."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from recforge.elastic.simulate import truth
from recforge.elastic.simulate.cluster import ClusterSpec
from recforge.elastic.simulate.engine import SimParams, Simulation
from recforge.elastic.simulate.limits import SimulationTooLarge, check_size, needed_bytes
from recforge.elastic.simulate.policies import (
    OptimusAllocator,
    fit_convergence,
    make_policy,
    steps_to_target,
)
from recforge.elastic.simulate.trace import TraceParams, generate_trace

GiB = float(1 << 30)
SMALL = TraceParams(n_jobs=24, arrival_window_h=3.0, n_scenarios=6)


def test_torchrec_jobs_have_workers_only_and_embedding_memory_from_their_tables():
    tr = generate_trace(SMALL, seed=0)
    assert all(j.shape == "torchrec" and j.request["servers"] == 0 and j.tables for j in tr)
    j = tr[0]
    assert j.emb_bytes == pytest.approx(sum(j.tables))
    # the most loaded worker holds base + skew x (state / workers): halving the workers doubles the shard
    m4 = truth.tr_worker_memory(j.worker_mem, j.emb_bytes, 4)
    m8 = truth.tr_worker_memory(j.worker_mem, j.emb_bytes, 8)
    assert m4 - j.worker_mem == pytest.approx(2 * (m8 - j.worker_mem))
    assert m8 == pytest.approx(j.worker_mem + truth.SHARD_SKEW * j.emb_bytes / 8)
    # requests other than "low_memory" fit their shard at the end of the job
    for x in tr:
        end = truth.tr_worker_memory(x.worker_mem, x.emb_bytes, x.request["workers"], x.emb_growth_per_sample
                                     * x.total_samples)
        if x.misconfig != "low_memory" and x.request["memory_per_worker"] < 0.999 * 120 * GiB:
            assert x.request["memory_per_worker"] >= end


def test_torchrec_throughput_is_the_trainers_fitted_form():
    c = truth.trainer_coefficients()
    assert c["a0"] > 0 and c["a1"] > 0 and c["a2"] > 0 and c["points"] >= 6  # fitted on the committed profile
    coef = {"a0": 0.01, "a1": 1e-4, "a2": 0.02}
    t = truth.tr_step_time(coef, 0.8, 1024, 8, 4.0)
    assert t == pytest.approx(0.01 + 1e-4 * 1024 / 4 ** 0.8 + 0.02 * 3)
    assert truth.tr_throughput(coef, 0.8, 1024, 8, 4.0) == pytest.approx(8 * 1024 / t)
    # synchronous: a straggler's slow compute slows every worker's step
    assert truth.tr_throughput(coef, 0.8, 1024, 8, 4.0, slow=3.0) < truth.tr_throughput(coef, 0.8, 1024, 8, 4.0)
    assert 0 < truth.tr_cpu_used(coef, 0.8, 1024, 8, 4.0) <= 8 * 4


def _job(jid, remaining, thr, cpu=1.0, mem=1.0, min_w=1, max_w=3):
    return {"id": jid, "min_w": min_w, "max_w": max_w, "cpu": cpu, "mem": mem, "remaining": remaining,
            "thr": np.asarray(thr, float)}


def test_optimus_gives_the_next_worker_to_the_larger_marginal_gain():
    # A: 100 samples left, 10 -> 20 samples/s saves 100*(1/10 - 1/20) = 5 s; B: 100*(1/10 - 1/12) = 1.67 s
    a, b = _job("A", 100, [10, 20, 30]), _job("B", 100, [10, 12, 13])
    assert OptimusAllocator.allocate([a, b], cpu_total=3, mem_total=100) == {"A": 2, "B": 1}
    # with 1,000 samples left B saves 16.7 s: it gets the worker
    assert OptimusAllocator.allocate([a, _job("B", 1000, [10, 12, 13])], 3, 100) == {"A": 1, "B": 2}
    # all the room: A to its maximum, B too (every step still gains)
    assert OptimusAllocator.allocate([a, b], 6, 100) == {"A": 3, "B": 3}
    # no gain, no worker; no room for a minimum: 0
    assert OptimusAllocator.allocate([_job("C", 100, [10, 10, 9])], 3, 100) == {"C": 1}
    assert OptimusAllocator.allocate([a, _job("D", 100, [5, 6, 7], min_w=3)], 3, 100) == {"A": 3, "D": 0}


def test_optimus_convergence_fit_recovers_the_curve():
    b0, b1, b2 = 0.5, 4.0, 0.45
    k = np.linspace(0.1, 20, 12)
    fit = fit_convergence(k, 1 / (b0 * k + b1) + b2, grid=200)
    assert fit is not None
    target = 1 / (b0 * 50 + b1) + b2
    assert steps_to_target(fit, target) == pytest.approx(50, rel=0.1)
    assert fit_convergence(k[:2], k[:2]) is None


class CheckedSimulation(Simulation):
    """After every rate change: no node over capacity, free + placed pods = capacity."""

    def _set_rate(self, r, t):
        super()._set_rate(r, t)
        cl = self.cluster
        assert cl.free_cpu.min() >= -1e-6 and cl.free_mem.min() >= -1.0
        placed = sum(c for x in self.runs.values() if x.where is not None for c, _ in x.pods)
        assert placed + cl.free_cpu.sum() == pytest.approx(cl.capacity_cpu)
        assert cl.free_cpu_total == pytest.approx(cl.free_cpu.sum())


@pytest.mark.parametrize("policy", ["static", "optimus", "dlrover"])
def test_engine_invariants_and_accounting(policy):
    tr = generate_trace(SMALL, seed=1)
    sim = CheckedSimulation(tr, make_policy(policy), ClusterSpec(nodes=6), SimParams(eviction_per_node_h=0.01), 1)
    r = sim.run()
    assert r["jobs"] == SMALL.n_jobs and r["completed"] + sum(r["failures"].values()) == r["jobs"]
    assert all(p["status"] in ("done", "failed") for p in r["per_job"])
    assert sim.cluster.free_cpu.sum() == pytest.approx(sim.cluster.capacity_cpu)  # everything released
    assert 0 < r["cpu_utilization"] <= 1 and 0 < r["memory_utilization"] <= 1
    if policy == "optimus":
        assert r["plan_changes"] > 0


def test_deterministic_under_a_seed():
    def run(seed):
        tr = generate_trace(SMALL, seed=seed)
        r = Simulation(tr, make_policy("optimus"), ClusterSpec(nodes=6), SimParams(), seed).run()
        return json.dumps(r, sort_keys=True, default=str)

    assert run(2) == run(2) and run(2) != run(3)


def test_a_size_the_machine_cannot_hold_is_refused_before_it_starts():
    with pytest.raises(SimulationTooLarge, match=r"need ~.*GiB.*only 1.0 GiB is available"):
        check_size(100_000, 10_000, available=1 << 30)
    assert check_size(1000, 100, available=64 << 30) == needed_bytes(1000, 100)
    with pytest.raises(SimulationTooLarge, match="at least 1 job"):
        check_size(0, 10, available=64 << 30)
    with pytest.raises(ValueError, match="shape"):
        replace(SMALL, shape="k8s")
    assert not math.isnan(needed_bytes(1, 1))
