"""DLRover-RM's decisions that raise CPU and memory utilization (issue 17, sixth session): CPU right-sizing taken to
where DLRover's rule stops (stage 2 on measured, stage 1 on predicted utilization), worker peaks converted to the
plan's worker count (stage 1) and pod memory that follows the shard when stage 2 changes the count, and worker memory
right-sized to the peak the measured growth predicts at the end (stage 2)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from recforge.elastic.optimizer import (
    InMemoryHistory,
    JobDescription,
    JobLimits,
    JobRecord,
    Observation,
    OptimizerConfig,
    PodPlan,
    RuntimeStage,
    ThroughputModel,
    embedding_shard_bytes,
    search,
    warm_start,
)
from recforge.elastic.optimizer.search import pod_memory_at, predicted_worker_util, rightsize_predicted
from recforge.elastic.optimizer.warm_start import _memory_from_history

GiB = float(1 << 30)
TABLES = (8 * GiB,) * 8  # table-wise: 4 workers hold 16 GiB each, 8 workers 8 GiB, 2 workers 32 GiB
TERMS = ("const", "b_per_cpu", "log_w")
# a job whose collectives dominate at 16 x 16 cores: most of each step its cores wait
COMM_BOUND = ThroughputModel(TERMS, (0.05, 1e-3, 0.05))
REQ = PodPlan(workers=16, cpu_per_worker=16.0, memory_per_worker=40 * GiB, batch_size=512)
TR_JOB = JobDescription("d", "dlrm", REQ, total_samples=1e9, table_bytes=TABLES)
LIMITS = JobLimits(cpu=1024, memory=4000 * GiB, max_memory_per_pod=120 * GiB, max_cpu_per_worker=32)


def _util(model: ThroughputModel, plan: PodPlan) -> float:
    """The compute share of the step (const, b_per_cpu, log_w): every core busy in b_per_cpu, none otherwise."""
    c0, c1, c2 = model.coef
    compute = c1 * plan.batch_size / plan.cpu_per_worker
    return compute / (c0 + compute + c2 * math.log2(plan.workers))


def _rule_reference(model: ThroughputModel, plan: PodPlan, low: float = 0.7, headroom: float = 1.25) -> float:
    """DLRover's right-sizing rule applied again and again on the model's utilization, written out plainly."""
    c = plan.cpu_per_worker
    while True:
        u = _util(model, replace(plan, cpu_per_worker=c))
        target = max(1.0, math.ceil(u * c * headroom))
        if u >= low or target >= c:
            return c
        c = float(target)


# ---- the shard conversion ----------------------------------------------------------------------------------------
def test_a_peak_converted_to_another_worker_count_swaps_the_shard():
    assert embedding_shard_bytes(TABLES, 4) == 16 * GiB and embedding_shard_bytes(TABLES, 8) == 8 * GiB
    # 20 GiB at 4 workers (4 GiB besides a 16 GiB shard): at 8 workers the shard is 8 GiB smaller
    assert pod_memory_at(20 * GiB, TR_JOB, 4, 8) == pytest.approx(12 * GiB)
    # fewer workers: the 8 GiB more shard x emb_factor (weights and optimizer state) x margin
    assert pod_memory_at(12 * GiB, TR_JOB, 8, 4, emb_factor=2.0) == pytest.approx(28 * GiB)
    assert pod_memory_at(12 * GiB, TR_JOB, 8, 4, emb_factor=2.0, margin=1.5) == pytest.approx(36 * GiB)
    # a smaller shard takes off its own bytes only, whatever the factor (the weights are resident at least once)
    assert pod_memory_at(20 * GiB, TR_JOB, 4, 8, emb_factor=2.0, margin=1.5) == pytest.approx(12 * GiB)
    # nothing to convert: the same count, no tables, a parameter-server job (its workers hold no shard)
    assert pod_memory_at(20 * GiB, TR_JOB, 4, 4) == 20 * GiB
    assert pod_memory_at(20 * GiB, replace(TR_JOB, table_bytes=()), 4, 8) == 20 * GiB
    assert pod_memory_at(20 * GiB, replace(TR_JOB, parameter_server=True), 4, 8) == 20 * GiB


def _peak_record(workers: int, peak: float, t: float, model: ThroughputModel | None = None) -> JobRecord:
    return JobRecord("d", "dlrm", replace(REQ, workers=workers, cpu_per_worker=4.0).to_dict(), model=model,
                     peak_memory_bytes=peak, finished_at=t)


def test_stage1_converts_similar_jobs_peaks_to_its_worker_count():
    # the median of 4, 8, 8 workers is 8: the 20 GiB peak at 4 workers is 12 GiB at 8, so the largest peak is
    # 12 GiB and the pods get 1.2 x 12 GiB (unconverted: 1.2 x 20 GiB, two thirds of it never used)
    hist = InMemoryHistory([_peak_record(4, 20 * GiB, 1), _peak_record(8, 11 * GiB, 2), _peak_record(8, 10 * GiB, 3)])
    ws = warm_start(TR_JOB, hist, LIMITS)
    assert ws.plan.workers == 8
    assert ws.plan.memory_per_worker == pytest.approx(1.2 * 12 * GiB)


def test_stage1_sizes_a_plan_with_fewer_workers_for_its_bigger_shard():
    # a peak of 11 GiB at 8 workers (3 GiB + 8 GiB shard); at 4 workers the shard is 16 GiB: a pod of 1.2 x 11 GiB
    # would run out of memory at once (3 + 16 = 19 GiB needed)
    recs = [_peak_record(8, 11 * GiB, 1)]
    plan = _memory_from_history(replace(REQ, workers=4), recs, [], OptimizerConfig(), LIMITS, TR_JOB, emb_factor=2.0)
    assert plan.memory_per_worker == pytest.approx(1.2 * (11 + 2 * 8) * GiB)
    assert plan.memory_per_worker >= 19 * GiB
    # without the job's tables the peak is taken as it was measured (DLRover's rule)
    old = _memory_from_history(replace(REQ, workers=4), recs, [], OptimizerConfig(), LIMITS)
    assert old.memory_per_worker == pytest.approx(1.2 * 11 * GiB)


# ---- CPU right-sizing to where the rule stops -------------------------------------------------------------------
def test_predicted_utilization_is_the_compute_share_of_the_step():
    plan = replace(REQ, workers=8, cpu_per_worker=4.0)
    assert predicted_worker_util(plan, COMM_BOUND) == pytest.approx(_util(COMM_BOUND, plan))
    # per-sample serial work keeps one core busy
    serial = ThroughputModel(("const", "b"), (0.1, 1e-4))
    assert predicted_worker_util(plan, serial) == pytest.approx((1e-4 * 512 / 4) / (0.1 + 1e-4 * 512))
    assert predicted_worker_util(plan, ThroughputModel(("const", "log_w"), (0.1, 0.1))) is None  # no compute term


def test_rightsize_predicted_stops_where_the_rule_stops():
    sized, u = rightsize_predicted(REQ, COMM_BOUND, LIMITS, OptimizerConfig())
    assert sized.cpu_per_worker == _rule_reference(COMM_BOUND, REQ) == 2.0  # 16 -> 3 -> 2 cores
    assert u == pytest.approx(_util(COMM_BOUND, sized))
    again, _ = rightsize_predicted(sized, COMM_BOUND, LIMITS, OptimizerConfig())
    assert again == sized  # a fixed point
    busy = replace(REQ, cpu_per_worker=2.0, workers=1)  # compute-bound: nothing to give back
    assert rightsize_predicted(busy, COMM_BOUND, LIMITS, OptimizerConfig())[0] == busy


def test_stage1_plans_the_cores_stage2_would_right_size_to():
    hist = InMemoryHistory([_peak_record(16, 10 * GiB, t, COMM_BOUND) for t in (1, 2, 3)])
    cfg = OptimizerConfig()
    ws = warm_start(TR_JOB, hist, LIMITS, cfg)
    e = ws.events[-1]
    assert e.action == "initial_plan" and "right-sizing rule on the predicted utilization" in e.reason
    # a fixed point of the rule, and of the search without more cores per worker (as stage 2 searches after it)
    assert rightsize_predicted(ws.plan, ws.prior, LIMITS, cfg)[0].cpu_per_worker == ws.plan.cpu_per_worker
    _, moves = search(ws.plan, ws.prior, LIMITS, cfg, TR_JOB, frozen=frozenset({"add_cpu_per_worker"}))
    assert not [m for m in moves if m.action.startswith("add")]
    # without right-sizing, stage 1 keeps the search's cores (more than the rule leaves)
    plain = warm_start(TR_JOB, hist, LIMITS, replace(cfg, rightsize=False))
    assert plain.plan.cpu_per_worker > ws.plan.cpu_per_worker


def _obs(t, plan, thr, util, mem, step=0, total=None):
    return Observation(t, plan, samples_per_s=thr, step=step, worker_cpu_util=[util] * 4, worker_memory=[mem] * 4,
                       total_steps=total)


def test_stage2_rightsizes_cpu_in_one_relaunch_to_where_the_rule_stops():
    cfg = OptimizerConfig(min_gain_ratio=1e9, profile_samples=3)
    st = RuntimeStage(TR_JOB, LIMITS, cfg, COMM_BOUND)
    u = _util(COMM_BOUND, REQ)  # what the workers measure
    thr = COMM_BOUND.predict(REQ.allocation())
    evs = [e for t in (0, 100, 200) for e in st.observe(_obs(t, REQ, thr, u, 10 * GiB))]
    ch = [e for e in evs if e.changes_plan]
    assert len(ch) == 1 and ch[0].action == "rightsize"
    # DLRover's rule once: ceil(0.113 x 16 x 1.25) = 3 cores (and a relaunch at 3 would right-size again to 2)
    assert math.ceil(u * 16 * 1.25) == 3
    assert PodPlan.from_dict(ch[0].plan_after).cpu_per_worker == 2.0 == _rule_reference(COMM_BOUND, REQ)
    assert "applied 2 times" in ch[0].reason


# ---- memory that follows the shard and the measured growth -------------------------------------------------------
def test_stage2_worker_moves_carry_the_pod_memory_to_the_new_shard():
    model = ThroughputModel(TERMS, (0.01, 1e-3, 0.001))  # more workers pay: the search adds them
    cfg = OptimizerConfig(rightsize=False, profile_samples=1, interval_s=0.0)
    plan = replace(REQ, workers=2, cpu_per_worker=2.0, memory_per_worker=40 * GiB)  # 8 GiB + a 32 GiB shard
    st = RuntimeStage(TR_JOB, LIMITS, cfg, model, memory=None)
    # (cores the workers leave idle are not added to: the search adds workers)
    ev = [e for e in st.observe(_obs(0, plan, model.predict(plan.allocation()), 0.3, 30 * GiB)) if e.changes_plan]
    new = PodPlan.from_dict(ev[0].plan_after)
    assert new.workers > 2
    shrink = embedding_shard_bytes(TABLES, 2) - embedding_shard_bytes(TABLES, new.workers)
    assert shrink > 0 and new.memory_per_worker == pytest.approx(40 * GiB - shrink)


def test_stage2_rightsizes_worker_memory_to_the_peak_the_growth_predicts():
    cfg = OptimizerConfig(min_gain_ratio=1e9, profile_samples=3)
    plan = replace(REQ, memory_per_worker=16 * GiB)
    thr = COMM_BOUND.predict(plan.allocation())
    st = RuntimeStage(TR_JOB, LIMITS, cfg, COMM_BOUND)
    # +0.1 GiB per 100 steps: 4.2 GiB at step 200 is 5.0 GiB at step 1,000, the end; pods of 1.2 x 5.0 GiB
    evs = [e for s in (0, 100, 200) for e in st.observe(_obs(s, plan, thr, 0.95, (4 + s / 1000) * GiB, s, 1000))]
    ch = [e for e in evs if e.changes_plan]
    assert PodPlan.from_dict(ch[0].plan_after).memory_per_worker == pytest.approx(1.2 * 5.0 * GiB)
    assert "predicted by the end" in ch[0].reason


def test_stage2_does_not_shrink_a_pod_the_growth_will_fill():
    # +1 GiB per 100 steps: 6 GiB at step 200 is 14 GiB at the end; 1.5 x the 6 GiB peak (9 GiB, the rule without
    # the trend) would run out of memory, so the 16 GiB pods stay (1.2 x 14 GiB is not 1.3x below them)
    cfg = OptimizerConfig(min_gain_ratio=1e9, profile_samples=3)
    plan = replace(REQ, memory_per_worker=16 * GiB)
    thr = COMM_BOUND.predict(plan.allocation())
    st = RuntimeStage(TR_JOB, LIMITS, replace(cfg, low_util=0.0), COMM_BOUND)
    evs = [e for s in (0, 100, 200) for e in st.observe(_obs(s, plan, thr, 0.95, (4 + s / 100) * GiB, s, 1000))]
    assert not [e for e in evs if e.changes_plan]
    # with no step count to extrapolate to, the measured peak x 1.5 (DLRover's rule) still applies
    st = RuntimeStage(TR_JOB, LIMITS, replace(cfg, low_util=0.0), COMM_BOUND)
    evs = [e for s in (0, 100, 200) for e in st.observe(_obs(s, plan, thr, 0.95, 6 * GiB, s, None))]
    assert PodPlan.from_dict([e for e in evs if e.changes_plan][0].plan_after).memory_per_worker \
        == pytest.approx(9 * GiB)
