"""DLRover-RM stages 2/3 executed by the elastic runtime: decisions become relaunches, with real
torchrun processes (the stub worker) for the supervisor's side."""
from __future__ import annotations

import json

import numpy as np
import pytest

from recforge.config import ResourceConfig
from recforge.elastic.job import run_training_job
from recforge.elastic.master.dlrover_scaler import DLRoverScaler, scaler_from_stage1
from recforge.elastic.master.supervisor import Rescale
from recforge.elastic.optimizer import DLRoverPolicy, GiB, JobLimits, OptimizerConfig, ResourceLimitError
from recforge.elastic.policy import JobInfo, ResourcePlan, StaticPolicy
from recforge.pipelines.hooks.resource_planning import pipeline_limits, pipeline_plan
from test_elastic_local import SHARDS, stub_backend, stub_spec

LIMITS = JobLimits(cpu=2.0, memory=64 * GiB, max_cpu_per_worker=2.0)


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def policy_for(workers=2, *, memory=4 * GiB, table_bytes=(), cfg=OptimizerConfig(profile_samples=100), limits=LIMITS):
    """Stage 1 (cold start) for a stub job; `profile_samples=100` keeps stage 2 quiet."""
    p = DLRoverPolicy(limits=limits, config=cfg, default_model=None)
    p.plan(JobInfo(shard_rows=SHARDS, epochs=2, rows_per_task=8, resources=ResourceConfig(workers=workers),
                   extra={"batch_size": 4, "host_cores": 2.0, "memory_per_worker": memory,
                          "table_bytes": list(table_bytes)}))
    return p


def state(workers: dict[str, int], rows: int, generation=0, **launch):
    return {"rows_done_total": rows, "launch": launch,
            "workers": {w: {"samples": n, "generation": generation} for w, n in workers.items()}}


# ---- decisions -> Rescale (no processes) -----------------------------------------------------
def test_a_straggler_is_replaced_by_a_relaunch_at_the_same_size_then_paced():
    clock = Clock()
    s = DLRoverScaler(policy_for(cfg=OptimizerConfig(profile_samples=100, interval_s=60.0)), min_interval_s=1.0,
                      clock=clock)
    running, decision = ResourcePlan(2, 1), None
    for i in range(1, 6):  # rank1 does a third of rank0's rows: step time 3x
        clock.t += 1
        decision = s(state({"rank0": 300 * i, "rank1": 100 * i}, 400 * i), running)
        if decision is not None:
            break  # the supervisor consults the scaler no more while a decision is pending
    assert isinstance(decision, Rescale) and decision.relaunch and decision.workers == 2 and not decision.immediate
    ev = [e for e in s.events if e.action == "replace_straggler"][0]
    assert ev.inputs["worker_step_s"][1] == pytest.approx(3 * ev.inputs["worker_step_s"][0], rel=0.05)
    decision.report(True, "relaunched")
    assert ev.executed and "[executed: relaunched]" in ev.reason
    for i in range(6, 10):  # still straggling, within the pacing interval: logged once, not executed
        clock.t += 1
        assert s(state({"rank0x": 300 * i, "rank1x": 100 * i}, 400 * i), running) is None
    paced = [e for e in s.events if e.action == "replace_straggler" and not e.executed]
    assert len(paced) == 1 and "not executed: paced" in paced[0].reason


def test_equal_workers_and_the_old_groups_stale_stats_are_no_straggler():
    clock = Clock()
    s = DLRoverScaler(policy_for(), min_interval_s=1.0, clock=clock)
    for i in range(1, 6):
        clock.t += 1
        old = {"old0": {"samples": 50, "generation": 0}}  # a replaced group's worker stops reporting
        st = state({"rank0": 200 * i, "rank1": 200 * i}, 400 * i, generation=1)
        st["workers"].update(old)
        assert s(st, ResourcePlan(2, 1)) is None
    assert not [e for e in s.events if e.stage == "instability"]


@pytest.mark.parametrize("action, kwargs", [("accumulate", {"grad_accumulation_factor": 2}),
                                            ("more_memory", {"memory_factor": pytest.approx(4.5 * 1.2)})])
def test_predicted_memory_exhaustion_becomes_accumulation_locally_and_memory_on_kubernetes(action, kwargs):
    # one 2 GiB table on one of 2 workers: the memory model predicts 0.5 + 2 x 2 = 4.5 GiB > 1 GiB
    s = DLRoverScaler(policy_for(memory=1 * GiB, table_bytes=[2 * GiB]), memory_action=action, clock=Clock())
    d = s(state({}, 0, grad_accumulation=1), ResourcePlan(2, 1))
    assert isinstance(d, Rescale) and d.workers == 2 and not d.immediate
    for k, v in kwargs.items():
        assert getattr(d, k) == v
    ev = s.events[0]
    assert ev.action == "relaunch_workers_more_memory" and ev.prediction["peak_bytes"] == pytest.approx(4.5 * GiB)
    d.report(True, "done")
    assert s.plan.memory_per_worker == ev.plan_after["memory_per_worker"]  # booked: no second relaunch
    assert s(state({}, 0, grad_accumulation=2), ResourcePlan(2, 1)) is None


def test_accumulation_stops_at_its_cap_and_says_so():
    s = DLRoverScaler(policy_for(memory=1 * GiB, table_bytes=[2 * GiB]), max_grad_accumulation=4, clock=Clock())
    assert s(state({}, 0, grad_accumulation=4), ResourcePlan(2, 1)) is None
    assert "not executed: gradient accumulation is at 4" in s.events[0].reason and not s.events[0].executed


def test_a_launch_pending_past_the_timeout_is_relaunched_smaller_at_once():
    s = DLRoverScaler(policy_for(cfg=OptimizerConfig(profile_samples=100, pending_timeout_s=30.0)), clock=Clock())
    assert s(state({}, 0, pending_s=10.0), ResourcePlan(2, 1)) is None
    s.clock.t += 10
    d = s(state({}, 0, pending_s=40.0), ResourcePlan(2, 1))
    assert isinstance(d, Rescale) and d.immediate and d.workers == 1
    assert s.events[-1].action == "relaunch_smaller" and s.events[-1].inputs["pending_s"] == 40.0


def test_a_stage_that_raises_an_expected_error_is_a_fallback_event_and_a_bug_propagates():
    s = DLRoverScaler(policy_for(), clock=Clock())

    def degenerate(obs):
        raise np.linalg.LinAlgError("Singular matrix")

    s.instability.observe = degenerate
    assert s(state({}, 0), ResourcePlan(2, 1)) is None
    assert s.events[0].action == "fallback" and "LinAlgError: Singular matrix" in s.events[0].reason
    s.instability.observe = lambda obs: 1 / 0  # not an error the optimizer expects (errors.py): a bug
    s.clock.t += 10
    with pytest.raises(ZeroDivisionError):
        s(state({}, 0), ResourcePlan(2, 1))


# ---- the supervisor carries them out (stub worker under real torchrun) -----------------------
def run_stub(tmp_path, scaler, workers=2):
    res = ResourceConfig(policy="static", workers=workers, threads_per_worker=1, max_restarts=0)
    return run_training_job(stub_spec(tmp_path / "out", obey_stop=True), SHARDS, resources=res,
                            state_dir=tmp_path / "job", policy=StaticPolicy(res, cpu_count=2),
                            backend=stub_backend(max_restarts=0), scaler=scaler, timeout_s=120, poll_s=0.1)


def test_predicted_oom_relaunches_the_group_with_twice_the_gradient_accumulation(tmp_path):
    s = DLRoverScaler(policy_for(memory=1 * GiB, table_bytes=[2 * GiB]), min_interval_s=0.1)
    result = run_stub(tmp_path, s)
    assert result.finished and [a["outcome"] for a in result.attempts] == ["rescaled", "finished"]
    assert [a["grad_accumulation"] for a in result.attempts] == [1, 2] and result.grad_accumulation == 2
    assert "x2 gradient accumulation" in result.attempts[0]["decision"]
    spec = json.loads(result.spec_path.read_text())
    assert spec["recovery"]["grad_accumulation"] == 2 and spec["recovery"]["global_batch"] == 8
    (ev,) = [e for e in s.events if e.executed]
    assert ev.action == "relaunch_workers_more_memory" and "[executed: rescale 2 -> 2 worker(s)" in ev.reason
    # every task done exactly once across the two groups (the master refuses a second DONE)
    # 6 tasks of <= 8 rows per epoch
    assert result.master_state["rows_done_total"] == 2 * sum(SHARDS) and result.tasks_done == 2 * 6


def test_supervisor_turns_decisions_into_scale_requests_and_reports_refusals(tmp_path):
    """A real job master in process (no workers): what _maybe_scale asks for, what it refuses, and the
    plan the next launch gets."""
    from recforge.elastic.master.failover import FailoverPolicy
    from recforge.elastic.master.service import JobMaster
    from recforge.elastic.master.supervisor import Supervisor

    notes, answers = [], []

    def scaler(st, running):
        assert "launch" in st and st["launch"]["grad_accumulation"] == 1
        return answers.pop(0)

    def note(ok, text):
        notes.append((ok, text))

    master = JobMaster(SHARDS, rows_per_task=8, epochs=1, max_workers=2)
    sup = Supervisor(master, stub_backend(), FailoverPolicy(), lambda *a: tmp_path, plan=ResourcePlan(2, 1),
                     batch_size=4, scaler=scaler)
    answers[:] = [Rescale(workers=5, reason="too many", on_applied=note),
                  Rescale(workers=2, grad_accumulation_factor=8, reason="too fine", on_applied=note),
                  Rescale(workers=2, reason="nothing changes", on_applied=note),
                  Rescale(workers=1, threads_per_worker=2, reason="test", on_applied=note)]
    for _ in range(4):
        sup._maybe_scale(handle=None)
    assert notes[0][0] is False and "rejected by the job master" in notes[0][1] and "max_workers=2" in notes[0][1]
    assert notes[1] == (False, "8 micro-batches do not divide the 4 rows a rank trains per step")
    assert len(notes) == 2 and master.pending_scale["workers"] == 1  # a no-op is not requested
    master.join("w", 0)
    assert master.command("w", 0)["command"] == "stop"  # the group checkpoints and stops at its next window
    text = sup._apply(sup._decision_for(master.take_scale()), "test")
    assert sup.plan == ResourcePlan(1, 2) and text == "rescale 2 -> 1 worker(s), 1 -> 2 thread(s) each: test"
    assert notes[2] == (True, text)


# ---- bad input ------------------------------------------------------------------------------
def test_limits_below_one_worker_name_the_setting():
    with pytest.raises(ResourceLimitError, match=r"resources.dlrover \(max_cpu=0.5.*below one worker"):
        pipeline_limits(max_cpu=0.5)
    assert pipeline_limits(max_cpu=2, max_workers=3).max_workers == 3


def test_an_unreadable_stage1_state_is_a_clear_error():
    out = pipeline_plan(ResourceConfig(workers=1, policy="dlrover"), dataset="d", model_family="m", batch_size=64,
                        total_rows=1000, tables=[("C1", 10)], embedding_dim=4, history=None, limits=LIMITS)
    s = scaler_from_stage1(json.loads(json.dumps(out["state"])))
    assert s.plan.workers == 1 and s.policy.plan(None).workers == 1  # stage 1 is not run again
    for bad, match in (({**out["state"], "plan": {"workers": 0}}, "stage 1 state unreadable"),
                       ({k: v for k, v in out["state"].items() if k != "job"}, "KeyError"),
                       ({**out["state"], "prior": {"terms": ["nope"], "coef": [1]}}, "stage 1 state unreadable")):
        with pytest.raises(ValueError, match=match):
            scaler_from_stage1(bad)
    with pytest.raises(ResourceLimitError, match="limits.cpu=0.5"):
        scaler_from_stage1({**out["state"], "limits": {**out["state"]["limits"], "cpu": 0.5}})
