"""The three-stage optimizer: warm start, runtime scaling with guard rails, instability handling."""
from __future__ import annotations

import itertools
import json

import pytest

from recforge.config import ResourceConfig
from recforge.elastic.optimizer import (
    DLRoverPolicy,
    InstabilityStage,
    JobDescription,
    JobLimits,
    Observation,
    OptimizerConfig,
    PodPlan,
    ResourceLimitError,
    RuntimeStage,
    clamp,
    search,
    warm_start,
)
from recforge.elastic.optimizer.events import Event, read_jsonl, write_jsonl
from recforge.elastic.optimizer.models.history import InMemoryHistory, JobRecord
from recforge.elastic.optimizer.models.memory_model import GiB
from recforge.elastic.optimizer.models.throughput_model import PS_TERMS, ThroughputModel
from recforge.elastic.optimizer.search import candidates, plan_cost
from recforge.elastic.policy import JobInfo, Policy, ResourcePlan

MODEL = ThroughputModel(PS_TERMS, (0.02, 4e-4, 5e-5, 0.002, 0.001, 0.0005))
LIMITS = JobLimits(cpu=200, memory=800 * GiB)
REQ = PodPlan(workers=4, cpu_per_worker=8, memory_per_worker=8 * GiB, batch_size=512, servers=1, cpu_per_server=4,
              memory_per_server=16 * GiB)
JOB = JobDescription("criteo_kaggle", "dlrm", REQ, total_samples=1e9, parameter_server=True)


def _record(plan=REQ, model=MODEL, t=1.0):
    return JobRecord("criteo_kaggle", "dlrm", plan.to_dict(), samples_per_s=1e5, model=model,
                     peak_memory_bytes=3 * GiB, finished_at=t, extra={"peak_server_memory": 10 * GiB})


# ---- stage 1 -----------------------------------------------------------------------------
def test_cold_start_uses_the_request_and_says_so():
    ws = warm_start(JOB, InMemoryHistory(), LIMITS)
    assert ws.plan == REQ
    assert [e.action for e in ws.events] == ["cold_start"]
    assert "no similar job" in ws.events[0].reason
    assert ws.prior is None


def test_cold_start_clamps_a_request_above_the_limits():
    ws = warm_start(JOB, None, JobLimits(cpu=20, memory=800 * GiB))
    assert ws.plan.cpu_total <= 20 and ws.plan.workers >= 1
    assert "clamped" in ws.events[0].reason


def test_warm_start_from_similar_jobs_models_runs_the_search_on_their_median_model():
    other = ThroughputModel(PS_TERMS, tuple(c * 3 for c in MODEL.coef))
    hist = InMemoryHistory([_record(t=1), _record(t=2), _record(model=other, t=3),
                            JobRecord("other_data", "dlrm", REQ.to_dict(), model=other)])
    ws = warm_start(JOB, hist, LIMITS)
    assert ws.prior.coef == pytest.approx(MODEL.coef)  # median of (m, m, 3m) per coefficient
    e = ws.events[0]
    assert e.action == "initial_plan" and e.prediction["samples_per_s"] > 0
    assert LIMITS.fits(ws.plan)
    # the plan is where the greedy search stops: no single further unit clears the 0.2 ratio
    again, moves = search(ws.plan, ws.prior, LIMITS, OptimizerConfig(), JOB)
    assert not moves or moves[0].action.startswith("remove")
    # server memory from history: the peak per server scaled to this plan's server count, x1.2
    assert ws.plan.memory_per_server == pytest.approx(10 * GiB * REQ.servers / ws.plan.servers * 1.2)


def test_history_without_usable_models_gives_the_median_final_plan():
    plans = [PodPlan(w, 4, 4 * GiB, 512, 2, 4, 8 * GiB) for w in (2, 6, 10)]
    hist = InMemoryHistory([JobRecord("criteo_kaggle", "dlrm", p.to_dict()) for p in plans])
    hist.problems.append("run x: record.json corrupt")
    ws = warm_start(JOB, hist, LIMITS)
    assert ws.plan.workers == 6
    assert "no usable fitted model" in ws.events[0].reason
    assert ws.events[0].inputs["history_problems"] == ["run x: record.json corrupt"]


def test_a_broken_history_store_or_record_falls_back_without_crashing():
    class Broken:
        problems: list = []
        unavailable = (OSError,)

        def similar(self, *a, **k):
            raise OSError("mlflow down")

    ws = warm_start(JOB, Broken(), LIMITS)
    assert ws.plan == REQ and "history lookup failed" in ws.events[0].inputs["history_problems"][0]
    assert ws.events[0].action == "fallback" and "history store unavailable (OSError: mlflow down)" \
        in ws.events[0].reason  # more in test_optimizer_errors.py
    bad = InMemoryHistory([JobRecord("criteo_kaggle", "dlrm", {"workers": "many"})])
    ws = warm_start(JOB, bad, LIMITS)
    assert ws.plan == REQ and ws.events[-1].action in ("cold_start", "fallback")


@pytest.mark.parametrize("limits, match", [
    (JobLimits(cpu=0.5, memory=100 * GiB), "limits.cpu=0.5 is below one worker"),
    (JobLimits(cpu=8, memory=0.5 * GiB), "limits.memory=0.50 GiB is below one worker"),
    (JobLimits(cpu=8, memory=8 * GiB, max_workers=0), "max_workers=0"),
])
def test_limits_below_one_worker_are_a_clear_error(limits, match):
    with pytest.raises(ResourceLimitError, match=match):
        warm_start(JOB, None, limits)


# ---- stage 2 -----------------------------------------------------------------------------
def _exhaustive_best(plan, model, limits, cfg, job):
    """Reference: among all single unit changes, the best ratio (what greedy's first step must pick)."""
    base = model.predict(plan.allocation())
    best = None
    for name, p in candidates(plan, True, True):
        if not limits.fits(p):
            continue
        ratio = (((model.predict(p.allocation()) - base) / (plan_cost(p, cfg) - plan_cost(plan, cfg)))
                 / (base / plan_cost(plan, cfg)))
        if best is None or ratio > best[0]:
            best = (ratio, name)
    return best


def test_search_first_move_is_the_exhaustive_best_and_search_respects_limits_and_caps():
    cfg = OptimizerConfig()
    start = PodPlan(1, 1, 2 * GiB, 512, 1, 1, 4 * GiB)
    ref = _exhaustive_best(start, MODEL, LIMITS, cfg, JOB)
    plan, moves = search(start, MODEL, LIMITS, cfg, JOB, max_units=4)
    assert moves[0].action == ref[1] and moves[0].ratio == pytest.approx(ref[0])
    assert len(moves) == 4 and all(m.ratio >= cfg.min_gain_ratio for m in moves)
    small = JobLimits(cpu=12, memory=800 * GiB)
    plan, _ = search(start, MODEL, small, cfg, JOB)
    assert small.fits(plan) and plan.cpu_total <= 12


def _obs(t, plan, thr, **kw):
    return Observation(time_s=t, plan=plan, samples_per_s=thr, **kw)


def test_runtime_stage_profiles_then_acts_then_paces():
    cfg = OptimizerConfig(interval_s=300, profile_samples=3, rightsize=False)
    rt = RuntimeStage(JOB, LIMITS, cfg, MODEL)
    plan = REQ
    evs = []
    for t in (0, 60, 120):
        evs += rt.observe(_obs(t, plan, MODEL.predict(plan.allocation())))
    actions = [e.action for e in evs]
    assert actions[0] == "hold" and "profiling" in evs[0].reason
    change = [e for e in evs if e.changes_plan]
    assert len(change) == 1 and change[0].stage == "runtime"
    assert change[0].prediction["samples_per_s_after"] > change[0].prediction["samples_per_s_now"]
    new = PodPlan.from_dict(change[0].plan_after)
    assert LIMITS.fits(new) and len(change[0].action.split("+")) <= cfg.max_units_per_step
    # pacing: at the new plan, even after profiling, nothing changes within 300 s of the last change
    for t in (150, 200, 250, 300):
        for e in rt.observe(_obs(t, new, MODEL.predict(new.allocation()))):
            assert not e.changes_plan


def test_runtime_stage_stops_when_the_marginal_ratio_falls_below_threshold():
    cfg = OptimizerConfig(min_gain_ratio=50.0, rightsize=False, shrink_ratio=0.0)
    rt = RuntimeStage(JOB, LIMITS, cfg, MODEL)
    evs = [e for t in range(0, 2000, 100) for e in rt.observe(_obs(t, REQ, MODEL.predict(REQ.allocation())))]
    assert not any(e.changes_plan for e in evs)
    assert any("marginal ratio" in e.reason and "< 50.0" in e.reason for e in evs)


def test_runtime_rightsizes_idle_cpu_and_memory_like_dlrover():
    rt = RuntimeStage(JOB, LIMITS, OptimizerConfig(min_gain_ratio=1e9), MODEL)
    plan = REQ
    evs = []
    for t in (0, 100, 200):
        evs += rt.observe(_obs(t, plan, 1e5, worker_cpu_util=[0.2] * 4, server_cpu_util=[[0.9] * 3],
                               worker_memory=[2 * GiB] * 4, step=t))
    ch = [e for e in evs if e.changes_plan][0]
    after = PodPlan.from_dict(ch.plan_after)
    assert after.cpu_per_worker == 2  # ceil(0.2 * 8 * 1.25)
    assert after.memory_per_worker == pytest.approx(3 * GiB)  # 1.5 x the 2 GiB peak
    assert after.cpu_per_server == REQ.cpu_per_server  # busy servers keep their cores


def test_runtime_without_any_model_holds_with_a_fallback_event():
    rt = RuntimeStage(JOB, LIMITS, OptimizerConfig(), None)
    evs = [e for t in (0, 1, 2, 3) for e in rt.observe(_obs(t, REQ, 1e5))]
    assert evs[-1].action == "fallback" and "no model" in evs[-1].reason


# ---- stage 3 -----------------------------------------------------------------------------
def test_straggler_slower_than_twice_the_median_is_replaced():
    st = InstabilityStage(JOB, LIMITS)
    ev = st.observe(_obs(0, REQ, 1e5, worker_step_s=[0.1, 0.11, 0.25, 0.1]))
    assert [e.action for e in ev] == ["replace_straggler"] and "[2]" in ev[0].reason
    assert st.observe(_obs(0, REQ, 1e5, worker_step_s=[0.1, 0.11, 0.19, 0.1])) == []


def test_hot_server_over_three_samples_gets_more_cores_then_is_paced():
    st = InstabilityStage(JOB, LIMITS)
    ev = st.observe(_obs(0, REQ, 1e5, server_cpu_util=[[0.95, 0.92, 0.97]]))
    assert ev[0].action == "migrate_hot_server"
    assert PodPlan.from_dict(ev[0].plan_after).cpu_per_server == 2 * REQ.cpu_per_server
    assert st.observe(_obs(60, REQ, 1e5, server_cpu_util=[[0.95] * 3])) == []  # an hour between server changes
    assert st.observe(_obs(0, REQ, 1e5, server_cpu_util=[[0.95, 0.5, 0.97]])) == []


def test_predicted_memory_exhaustion_relaunches_with_double_memory_before_the_oom():
    st = InstabilityStage(JOB, LIMITS)
    plan = REQ  # 16 GiB servers, growing by 1 MiB a step, 1e9/512 steps in the job
    ev = []
    for step in (0, 1000, 2000, 3000):
        ev = st.observe(_obs(step, plan, 1e5, step=step, server_memory=[4 * GiB + step * 2**20]))
    assert ev[0].action == "relaunch_servers_more_memory"
    assert PodPlan.from_dict(ev[0].plan_after).memory_per_server == 24 * GiB  # 16 + 8 (double, at most +8)
    assert ev[0].prediction["peak_bytes"] > 16 * GiB


def test_a_rescale_resets_the_memory_trends():
    """Fewer servers hold bigger embedding shards: the memory jump at a rescale is not growth to extrapolate."""
    st = InstabilityStage(JOB, LIMITS)
    two = PodPlan.from_dict({**REQ.to_dict(), "servers": 2})
    for step in (0, 1000):
        assert st.observe(_obs(step, two, 1e5, step=step, server_memory=[4 * GiB] * 2)) == []
    # one server now holds both shards: 8 GiB from the start, flat; without the reset the jump reads as a slope
    for step in (1010, 2000, 3000):
        assert st.observe(_obs(step, REQ, 1e5, step=step, server_memory=[8 * GiB])) == []


def test_an_oom_relaunches_the_worker_group_with_more_memory():
    st = InstabilityStage(JOB, LIMITS)
    ev = st.observe(_obs(0, REQ, None, oom_workers=[1], worker_memory=[8 * GiB] * 4))
    assert ev[0].action == "relaunch_workers_more_memory" and "ran out of memory" in ev[0].reason
    assert PodPlan.from_dict(ev[0].plan_after).memory_per_worker == 16 * GiB


def test_pending_too_long_relaunches_smaller_a_bounded_number_of_times():
    st = InstabilityStage(JOB, LIMITS, OptimizerConfig(pending_timeout_s=900, max_pending_relaunches=2))
    assert st.observe(Observation(0, REQ, pending_s=100)) == []
    plan = REQ
    for expected in (2, 1):
        ev = st.observe(Observation(0, plan, pending_s=1000))
        assert ev[0].action == "relaunch_smaller"
        plan = PodPlan.from_dict(ev[0].plan_after)
        assert plan.workers == expected
    assert st.observe(Observation(0, plan, pending_s=5000))[0].action == "hold"


def test_events_round_trip_through_jsonl(tmp_path):
    ws = warm_start(JOB, InMemoryHistory([_record()]), LIMITS)
    e2 = Event("runtime", "hold", "why", inputs={"x": float("nan")})
    path = write_jsonl(ws.events + [e2], tmp_path / "ev.jsonl")
    back = read_jsonl(path)
    assert back[0].plan_after == ws.events[0].plan_after and back[1].inputs == {"x": "nan"}
    json.loads(path.read_text().splitlines()[0])
    with pytest.raises(ValueError, match="stage"):
        Event("nope", "x", "y")
    with pytest.raises(ValueError, match="reason"):
        Event("runtime", "x", "")


# ---- the Policy ----------------------------------------------------------------------------
def test_dlrover_policy_implements_the_policy_seam():
    pol = DLRoverPolicy(InMemoryHistory(), JobLimits(cpu=4, memory=16 * GiB, max_cpu_per_worker=4))
    assert isinstance(pol, Policy)
    job = JobInfo(shard_rows=[1000, 1000], epochs=1, rows_per_task=512,
                  resources=ResourceConfig(workers=8, threads_per_worker=2, policy="dlrover"),
                  extra={"dataset": "criteo_kaggle", "model_family": "dlrm", "batch_size": 512, "host_cores": 4})
    plan = pol.plan(job)
    assert isinstance(plan, ResourcePlan) and plan.workers * plan.threads_per_worker <= 4
    assert pol.events and pol.events[0].stage == "warm_start"
    assert isinstance(pol.runtime(), RuntimeStage) and isinstance(pol.instability(), InstabilityStage)
    with pytest.raises(RuntimeError, match="plan\\(job\\)"):
        DLRoverPolicy().runtime()


def test_clamp_never_returns_a_plan_outside_the_limits():
    for cpu, mem in itertools.product((1, 3, 17, 100), (1, 3, 40)):
        lim = JobLimits(cpu=cpu, memory=mem * GiB)
        if cpu < 2 or mem < 2:  # a parameter-server job needs one worker and one server, 1 core and 1 GiB each
            with pytest.raises(ResourceLimitError, match="cannot hold the minimal plan"):
                clamp(REQ, lim)
            continue
        p = clamp(REQ, lim)
        assert lim.fits(p) and p.workers >= 1 and p.servers >= 1
