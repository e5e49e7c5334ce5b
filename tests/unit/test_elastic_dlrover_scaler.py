"""DLRover-RM stage 2 driving rescales: observations built from the master's state, plan changes returned."""
from __future__ import annotations

import pytest

from recforge.config import ResourceConfig
from recforge.elastic.master.dlrover_scaler import DLRoverScaler
from recforge.elastic.optimizer import DLRoverPolicy, GiB, JobLimits, OptimizerConfig
from recforge.elastic.optimizer.models.throughput_model import ThroughputModel
from recforge.elastic.policy import JobInfo, ResourcePlan


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def linear_model():
    """Step time independent of the worker count: throughput grows with workers, stage 2 wants more."""
    return ThroughputModel(terms=("const", "b_per_cpu"), coef=(0.01, 0.001))


def test_scaler_feeds_the_runtime_stage_and_returns_worker_changes():
    cfg = OptimizerConfig(profile_samples=2, interval_s=0.0, rightsize=False)
    limits = JobLimits(cpu=8.0, memory=64 * GiB, max_workers=8, max_cpu_per_worker=8.0)
    policy = DLRoverPolicy(limits=limits, config=cfg, default_model=linear_model())
    res = ResourceConfig(workers=1, threads_per_worker=1)
    first = policy.plan(JobInfo(shard_rows=[10**7], epochs=1, rows_per_task=4096, resources=res,
                                extra={"batch_size": 512, "host_cores": 8.0, "memory_per_worker": 1 * GiB}))
    clock = Clock()
    scaler = DLRoverScaler(policy, min_interval_s=1.0, clock=clock)
    running = ResourcePlan(first.workers, first.threads_per_worker)
    model = linear_model()
    decisions = []
    rows = 0
    for _ in range(12):
        clock.t += 10
        alloc = scaler.plan.allocation(8.0)
        rows += int(model.predict(alloc) * 10)  # the job runs exactly as the model says
        want = scaler({"rows_done_total": rows}, running)
        if want is not None:
            decisions.append(want)
            running = want.plan_after(running)
            want.report(True, "relaunched")  # what the supervisor does when the relaunch starts
    assert decisions and decisions[0].workers * (decisions[0].threads_per_worker or 1) > first.workers, \
        [e.reason for e in scaler.events]
    executed = [e for e in scaler.events if e.executed]
    assert [(e.plan_after["workers"], e.plan_after["cpu_per_worker"]) for e in executed] == \
        [(d.workers, d.threads_per_worker) for d in decisions]
    assert all("[executed: relaunched]" in e.reason for e in executed)
    assert scaler.plan.workers == running.workers and running.workers * running.threads_per_worker <= limits.cpu
    assert all(e.stage == "runtime" and e.reason for e in scaler.events)


def test_scaler_rate_limits_and_needs_a_stage_1_plan():
    policy = DLRoverPolicy(limits=JobLimits(cpu=4.0, memory=16 * GiB), default_model=None)
    with pytest.raises(RuntimeError, match="call policy.plan"):
        DLRoverScaler(policy)
    res = ResourceConfig(workers=2, threads_per_worker=1)
    policy.plan(JobInfo(shard_rows=[1000], epochs=1, rows_per_task=100, resources=res, extra={"host_cores": 4.0}))
    clock = Clock()
    s = DLRoverScaler(policy, min_interval_s=30.0, clock=clock)
    assert s({"rows_done_total": 0}, ResourcePlan(2, 1)) is None
    n = len(s.events)
    clock.t += 5
    assert s({"rows_done_total": 100}, ResourcePlan(2, 1)) is None and len(s.events) == n  # too soon: not consulted
