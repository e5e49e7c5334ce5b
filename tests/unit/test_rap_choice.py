"""`preprocessing: auto`'s decision (recforge.rap.planning.choice: the cold pre-check's bound and the profiled
choice; the plan task's path through them, pipelines/hooks/rap_planning.py) and the run page's Gantt data of a co-run
(recforge.rap.planning.gantt): pure functions over predictions, schedules and a worker's co-run summary."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recforge.config import ModelConfig, PipelineConfig
from recforge.rap.planning.choice import (
    CORUN_MARGIN,
    ModeChoice,
    ModePredictions,
    StepBound,
    choose_by_bound,
    choose_mode,
    corun_saving_bound,
)
from recforge.rap.planning.gantt import gantt_tasks, measured_gantt
from recforge.rap.planning.schedule import Assignment, CorunSchedule
from recforge.rap.profiling.profiler import ProfileKey, StageProfile
from recforge.rap.profiling.stages import STAGES
from recforge.ui import charts

STAGE_MS = {"emb_fwd": 1.0, "mlp_fwd": 2.0, "mlp_bwd": 3.0, "emb_bwd": 1.0, "allreduce": 1.0}  # 8 ms


def _pred(corun_ms: float, prep_ms: float = 2.0, **kw) -> ModePredictions:
    return ModePredictions(train_ms=8.0, inline_prep_ms=prep_ms, corun_ms=corun_ms, **kw)


def test_auto_picks_corun_when_predicted_faster_by_more_than_the_margin():
    choice = choose_mode("auto", _pred(8.2, corun_kernel_ms=1.8, capacity_ms=1.6, mapping=True))
    assert (choice.requested, choice.mode) == ("auto", "corun")
    assert choice.predicted_inline_ms == 10.0 and choice.predicted_corun_ms == 8.2
    assert "18.0% faster" in choice.reason and "RAP's mapping" in choice.reason
    assert "capacity 1.600 ms against 1.800 ms" in choice.reason


def test_auto_picks_inline_when_corun_is_slower_or_within_the_margin():
    slower = choose_mode("auto", _pred(10.5, corun_kernel_ms=3.0, capacity_ms=0.0))
    assert slower.mode == "inline" and "slower than" in slower.reason
    assert slower.predicted_inline_ms == 10.0 and slower.predicted_corun_ms == 10.5
    close = choose_mode("auto", _pred(10.0 * (1 - CORUN_MARGIN / 2)))  # faster, but not by the margin
    assert close.mode == "inline" and "within the 5% margin" in close.reason
    edge = choose_mode("auto", _pred(10.0 * (1 - CORUN_MARGIN)))  # exactly the margin is not more than it
    assert edge.mode == "inline"
    assert choose_mode("auto", _pred(9.0), margin=0.2).mode == "inline"
    assert choose_mode("auto", _pred(9.0), margin=0.0).mode == "corun"


@pytest.mark.parametrize("mode", ["inline", "corun", "offline"])
def test_explicit_modes_are_kept(mode):
    choice = choose_mode(mode)
    assert (choice.requested, choice.mode, choice.reason) == (mode, mode, "configured")
    assert choice.predicted_inline_ms is None and choice.predicted_corun_ms is None
    # with predictions (explicit corun is planned and timed too) they are recorded, the mode still the configured one
    kept = choose_mode(mode, _pred(1.0))
    assert kept.mode == mode and kept.predicted_corun_ms == 1.0 and kept.predicted_inline_ms == 10.0


def test_bad_input_is_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="'fast' is not one of"):
        choose_mode("fast")
    with pytest.raises(ValueError, match="auto': needs the predicted iteration times"):
        choose_mode("auto")
    with pytest.raises(ValueError, match="margin must be a fraction"):
        choose_mode("auto", _pred(8.0), margin=1.5)
    with pytest.raises(ValueError, match="corun_ms: must be a finite number"):
        _pred(math.nan)
    with pytest.raises(ValueError, match="inline_prep_ms: must be a finite number"):
        _pred(8.0, prep_ms=-1.0)
    with pytest.raises(ValueError, match="capacity_ms: must be a finite number"):
        _pred(8.0, capacity_ms=math.inf)
    with pytest.raises(ValueError, match="train_ms: the profiled stages must take time"):
        ModePredictions(train_ms=0.0, inline_prep_ms=1.0, corun_ms=1.0)


def test_corun_saving_bound_is_the_preprocessing_share_and_grows_as_training_shrinks():
    assert corun_saving_bound(19.0, 1.0) == pytest.approx(0.05)
    assert corun_saving_bound(140.0, 0.8) == pytest.approx(0.8 / 140.8)
    assert corun_saving_bound(9.0, 1.0) > corun_saving_bound(19.0, 1.0) > corun_saving_bound(99.0, 1.0)
    assert corun_saving_bound(10.0, 0.0) == 0.0
    assert StepBound(train_lb_ms=19.0, inline_prep_ms=1.0).max_corun_saving == pytest.approx(0.05)


def test_bound_within_the_margin_chooses_inline_unprofiled_with_both_lower_bounds():
    choice = choose_by_bound("auto", StepBound(train_lb_ms=140.0, inline_prep_ms=0.8))
    assert (choice.requested, choice.mode, choice.bound) == ("auto", "inline", True)
    assert choice.predicted_inline_ms == 140.8 and choice.predicted_corun_ms == 140.0
    assert choice.reason == ("auto: preprocessing 0.800 ms of a >= 140.0 ms training step: co-run could save at "
                             "most 0.57%, not more than the 5% margin; not profiled")


def test_bound_above_the_margin_asks_for_the_profile():
    assert choose_by_bound("auto", StepBound(train_lb_ms=10.0, inline_prep_ms=1.0)) is None  # 9.1% > 5%
    assert choose_by_bound("auto", StepBound(train_lb_ms=140.0, inline_prep_ms=0.8), margin=0.005) is None
    assert choose_by_bound("auto", StepBound(train_lb_ms=140.0, inline_prep_ms=0.8), margin=0.0) is None


def test_bound_at_the_margin_is_decided_as_choose_mode_decides_it():
    # 1 ms of a 19 ms step: hiding all of it saves exactly 5%, which is not more than the margin
    at_edge = StepBound(train_lb_ms=19.0, inline_prep_ms=1.0)
    assert choose_by_bound("auto", at_edge).mode == "inline"
    assert choose_mode("auto", ModePredictions(train_ms=19.0, inline_prep_ms=1.0, corun_ms=19.0)).mode == "inline"
    assert choose_by_bound("auto", StepBound(train_lb_ms=18.99, inline_prep_ms=1.0)) is None  # just over


@pytest.mark.parametrize("requested", ["inline", "corun", "offline"])
def test_bound_keeps_explicit_modes_for_the_profile_or_configured_path(requested):
    assert choose_by_bound(requested, StepBound(train_lb_ms=140.0, inline_prep_ms=0.8)) is None


def test_bound_is_sound_and_tight_against_every_profile_it_allows():
    """Inline by the bound: choose_mode picks inline for every profile with training >= the bound and co-run >= the
    training (co-run hides at most the preprocessing). No inline by the bound: some such profile picks co-run."""
    for train_lb in (1.0, 7.3, 19.0, 140.0, 405.0):
        for prep in (0.0, 0.05, 0.8, 1.0, 7.0, 25.0):
            for margin in (0.0, 0.01, CORUN_MARGIN, 0.2):
                by_bound = choose_by_bound("auto", StepBound(train_lb, prep), margin)
                if by_bound is None:
                    best = ModePredictions(train_ms=train_lb, inline_prep_ms=prep, corun_ms=train_lb)
                    assert choose_mode("auto", best, margin).mode == "corun", (train_lb, prep, margin)
                    continue
                assert by_bound.mode == "inline"
                for train in (train_lb, train_lb * 1.01, train_lb * 3):
                    for corun in (train, train + prep / 2, train + prep, train * 2):
                        full = ModePredictions(train_ms=train, inline_prep_ms=prep, corun_ms=corun)
                        assert choose_mode("auto", full, margin).mode == "inline", (train_lb, prep, margin, train)


def test_bound_refuses_bad_input_naming_it():
    with pytest.raises(ValueError, match="train_lb_ms: a training step takes time"):
        StepBound(train_lb_ms=0.0, inline_prep_ms=1.0)
    with pytest.raises(ValueError, match="inline_prep_ms: must be a finite number"):
        StepBound(train_lb_ms=1.0, inline_prep_ms=math.nan)
    with pytest.raises(ValueError, match="'fast' is not one of"):
        choose_by_bound("fast", StepBound(train_lb_ms=1.0, inline_prep_ms=1.0))
    with pytest.raises(ValueError, match="margin must be a fraction"):
        choose_by_bound("auto", StepBound(train_lb_ms=1.0, inline_prep_ms=1.0), margin=-0.1)


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    """A small job of the pipeline's dataset: (config, plan, train manifest)."""
    from recforge.data.generator import generate_days
    from recforge.data.ingest import ingest
    from recforge.preprocess.presets import load_plan

    root = tmp_path_factory.mktemp("auto_job")
    cfg = PipelineConfig(model=ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1]), table_cap=50,
                         train={"batch_size": 32}, corun={"profile_dir": str(root / "profiles")}, seed=2)
    generate_days(cfg.dataset(), root / "raw", days=1, rows_per_day=160, seed=2)
    ingest([root / "raw" / "day_0.tsv"], cfg.dataset(), root / "data", rows_per_shard=160, max_bad_fraction=0.0)
    return cfg, load_plan(cfg.preprocess_plan, cfg.dataset(), cfg.table_cap), root / "data"


def _plan_auto(monkeypatch, recforge_home, job, key: str, margin: float):
    """plan_preprocessing of the tiny job, 'auto', one worker; (planned, calls of the profiling path, MLflow run)."""
    from recforge.pipelines.context import RunContext, StageWriter
    from recforge.pipelines.hooks import rap_planning
    from recforge.tracking import TrackingStore

    cfg, plan, manifest = job
    calls = {"ensure_profile": 0, "corun_candidate": 0}
    for name in calls:  # the real functions, counted
        real = getattr(rap_planning, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(rap_planning, name, counted)
    store = TrackingStore()
    run = store.stage_run("rap-auto-test", key, "plan_resources")
    writer = StageWriter(RunContext.create(key, cfg, home=recforge_home), "plan_resources")
    planned = rap_planning.plan_preprocessing(store, run, cfg, plan, 1, writer, manifest, margin=margin)
    return planned, calls, store.client.get_run(run).data


def test_cold_auto_within_the_bound_chooses_inline_without_profiling(monkeypatch, recforge_home, tiny_job):
    cfg, plan, _ = tiny_job
    threads, had_group = torch.get_num_threads(), dist.is_initialized()
    torch.manual_seed(7)
    # margin 0.99: hiding all the preprocessing cannot save 99% of an iteration, whatever the machine measures
    planned, calls, data = _plan_auto(monkeypatch, recforge_home, tiny_job, "bound", margin=0.99)
    after = torch.rand(1)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(1))  # the bound's training steps left this process's RNG as it was
    assert torch.get_num_threads() == threads and dist.is_initialized() == had_group
    choice = planned.choice
    assert (choice.requested, choice.mode, choice.bound) == ("auto", "inline", True)
    assert calls == {"ensure_profile": 0, "corun_candidate": 0}  # the profiler never ran
    assert not list(Path(cfg.corun.profile_dir).glob("*.json")) and not (recforge_home / "rap").exists()
    assert planned.corun is None and planned.rap_schedule is None
    m = data.metrics
    assert 0 < choice.predicted_corun_ms == pytest.approx(m["preprocessing_train_bound_ms"], abs=1e-4)
    assert choice.predicted_inline_ms == pytest.approx(
        m["preprocessing_train_bound_ms"] + m["preprocessing_predicted_inline_prep_ms"], abs=1e-3)
    assert m["preprocessing_corun_saving_bound"] == pytest.approx(corun_saving_bound(
        m["preprocessing_train_bound_ms"], m["preprocessing_predicted_inline_prep_ms"]))
    assert m["preprocessing_predicted_inline_ms"] == pytest.approx(choice.predicted_inline_ms)
    assert m["preprocessing_predicted_corun_ms"] == pytest.approx(choice.predicted_corun_ms)
    assert m["preprocessing_profile_s"] == 0 and m["preprocessing_train_bound_s"] > 0
    assert "preprocessing_predicted_train_ms" not in m  # nothing profiled to predict the stages from
    assert data.tags["preprocessing_predicted_by"] == "bound" and data.tags["preprocessing_mode"] == "inline"
    assert data.tags["preprocessing_reason"] == choice.reason and choice.reason.endswith("not profiled")
    assert "not more than the 99% margin" in choice.reason


def test_auto_with_a_stored_profile_predicts_from_it_without_the_bound(monkeypatch, recforge_home, tiny_job):
    cfg, plan, _ = tiny_job
    device = "cuda" if torch.cuda.is_available() else "cpu"
    stored = StageProfile(key=ProfileKey.of(cfg.model, plan.tables(), 1, 32, device), stage_ms=dict(STAGE_MS),
                          capacity_units={s: 0 for s in STAGES}, capacity_ms={s: 0.0 for s in STAGES},
                          unit_ms=0.01, threshold=0.1)
    path = stored.save(cfg.corun.profile_dir)
    try:
        planned, calls, data = _plan_auto(monkeypatch, recforge_home, tiny_job, "stored", margin=0.99)
    finally:
        path.unlink()
    choice = planned.choice
    # the margin that made the cold job inline unprofiled: with a stored profile the full prediction decides
    assert calls == {"ensure_profile": 1, "corun_candidate": 1} and not choice.bound
    assert choice.mode == "inline" and choice.reason.startswith("auto: corun predicted")
    assert choice.predicted_corun_ms >= sum(STAGE_MS.values())  # no spare capacity: nothing hidden
    m = data.metrics
    assert m["preprocessing_predicted_train_ms"] == pytest.approx(sum(STAGE_MS.values()))
    assert m["preprocessing_profile_s"] == 0 and "preprocessing_train_bound_s" not in m
    assert "preprocessing_train_bound_ms" not in m and data.tags["preprocessing_predicted_by"] == "profile"


def _schedule(parts: list[tuple[str, str, float]], name: str = "p") -> CorunSchedule:
    items = [Assignment(stage=s, group=g, features=(g,), predicted_ms=ms) for s, g, ms in parts]
    return CorunSchedule(stages=STAGES, plan_name=name, assignments=items)


def test_planned_gantt_stacks_each_stage_kernels_and_marks_what_is_not_hidden():
    capacity = {**{s: 0.0 for s in STAGES}, "mlp_bwd": 1.0}
    local = _schedule([("mlp_bwd", "L0:fill_null", 0.8), ("allreduce", "L1:logit", 0.5)])
    glob = _schedule([("mlp_bwd", "L0:sigrid_hash", 0.3)])
    doc = gantt_tasks([("global", glob), ("local", local)], STAGE_MS, capacity)
    by_name = {t["name"]: t for t in doc["tasks"]}
    assert doc["unit"] == "ms"
    assert [by_name[s]["start"] for s in STAGES] == [0.0, 1.0, 3.0, 6.0, 7.0]  # stages back to back
    assert by_name["mlp_bwd spare capacity"]["end"] == 4.0
    # the co-run thread runs the global job's part of a stage, then the local job's
    assert (by_name["L0:sigrid_hash"]["lane"], by_name["L0:sigrid_hash"]["start"]) == ("preprocess: global", 3.0)
    assert by_name["L0:fill_null"]["start"] == pytest.approx(3.3)
    assert by_name["L0:sigrid_hash"]["kind"] == "hidden"
    assert by_name["L0:fill_null"]["kind"] == "not hidden"  # ends at 4.1, past the capacity's edge at 4.0
    assert by_name["L1:logit"]["kind"] == "not hidden"  # no capacity in allreduce
    chart = charts.gantt(doc)  # the run page draws it
    assert chart["unit"] == "ms" and len(chart["bars"]) == len(doc["tasks"])


def test_measured_gantt_from_a_worker_summary():
    sched = _schedule([("mlp_bwd", "L0:fill_null", 0.6)])
    summary = {"measured_stage_ms": STAGE_MS, "kernel_ms_by_stage": {"mlp_bwd": 0.9}, "wait_ms": 0.25,
               "schedule": json.loads(sched.to_json())}
    doc = measured_gantt(summary)
    lanes = {t["lane"] for t in doc["tasks"]}
    assert lanes == {"train (measured)", "kernels (planned)", "kernels (measured)", "trainer waits"}
    measured = next(t for t in doc["tasks"] if t["lane"] == "kernels (measured)")
    planned = next(t for t in doc["tasks"] if t["lane"] == "kernels (planned)")
    assert (measured["start"], measured["end"], planned["end"]) == (3.0, 3.9, 3.6)
    wait = next(t for t in doc["tasks"] if t["lane"] == "trainer waits")
    assert (wait["start"], wait["end"]) == (8.0, 8.25)
    charts.gantt(doc)
    assert measured_gantt({"measured_stage_ms": {"emb_fwd": 1.0}, "schedule": None}) is None  # no full step


def test_a_retried_plan_task_may_choose_differently_without_failing(recforge_home):
    """The mode and what predicted it come from measurements: a retry that measures its way to another choice
    overwrites the tags instead of failing on an immutable param."""
    from recforge.pipelines.hooks.rap_planning import log_choice
    from recforge.tracking import TrackingStore

    store = TrackingStore()
    run_id = store.client.create_run(store.client.create_experiment("retry")).info.run_id
    first = ModeChoice("auto", "inline", "auto: bound", predicted_inline_ms=10.0, predicted_corun_ms=9.9, bound=True)
    second = ModeChoice("auto", "corun", "auto: corun predicted", predicted_inline_ms=10.0, predicted_corun_ms=5.0)
    log_choice(store, run_id, first)
    log_choice(store, run_id, second)
    data = store.client.get_run(run_id).data
    assert data.params == {"preprocessing_requested": "auto"}
    assert data.tags["preprocessing_mode"] == "corun" and data.tags["preprocessing_predicted_by"] == "profile"
    assert data.tags["preprocessing_reason"] == "auto: corun predicted"
