"""The daily pipeline's train task with `preprocessing: corun` (raw shards in, RAP co-running in the workers, the
schedule and predicted vs measured iteration time in MLflow), `auto` on a job with no stored profile (the cold
decision: the bound, or the profile, both predictions and the choice recorded, the chosen mode run) and `offline`
(the training data preprocessed first): same seeds, same model."""
from __future__ import annotations

import json

import pytest
import torch

from recforge.config import ModelConfig
from recforge.pipelines.context import RunContext
from recforge.pipelines.stages.data import generate, ingest
from recforge.pipelines.stages.plan import plan_resources
from recforge.pipelines.stages.train import train
from recforge.rap.planning.choice import CORUN_MARGIN, StepBound, choose_by_bound
from recforge.rap.profiling.profiler import ProfileKey, StageProfile
from recforge.rap.profiling.stages import STAGES
from recforge.tracking import TrackingStore
from recforge.train.result import WorkerResult
from recforge.ui import charts

pytestmark = pytest.mark.slow


def _ctx(home, key, preprocessing, workers=1, **extra):
    cfg = {"rows_per_day": 1200, "rows_per_shard": 600, "seed": 3, "table_cap": 500, "preprocessing": preprocessing,
           "resources": {"workers": workers, "policy": "static"},  # DLRover-RM would replan the worker count
           "train": {"batch_size": 128, "log_every": 2, "batches_per_task": 2}, **extra}
    return RunContext.create(key, cfg, home=home)


def _run(ctx):
    generate(ctx)
    ingest(ctx)
    planned = plan_resources(ctx)
    return planned, train(ctx)


def test_train_task_runs_corun_and_offline(recforge_home):
    planned, out = _run(_ctx(recforge_home, "corun", "corun"))
    corun = planned.corun
    assert corun.schedule_path.endswith("corun_schedule.json")
    assert corun.mapping_path is None  # one worker: no input all-to-all to remove, so no mapping
    schedule = json.loads(open(corun.schedule_path).read())
    # no profile was stored for this job: plan_resources profiled it, stored it, and RAP's scheduler used it
    assert corun.profile.origin == "profiled"
    key = ProfileKey.of(ModelConfig(), planned.tables, 1, 128, "cpu")
    profile = StageProfile.load(recforge_home / "rap" / "profiles", key)
    assert corun.profile.key == key.slug() and profile.stage_ms == corun.profile.stage_ms
    assert all(profile.stage_ms[s] > 0 for s in STAGES) and profile.meta["single_process"]
    meta = schedule["meta"]
    assert f"RAP scheduler over stage profile {key.slug()}" in meta["source"]  # not the one-stage fallback
    assert meta["stage_ms"] == profile.stage_ms and meta["capacity_ms"] == profile.capacity_ms
    # on a CPU the co-run thread runs the whole batch from emb_fwd; RAP's own schedule is recorded beside it
    assert {a["stage"] for a in schedule["assignments"]} == {"emb_fwd"}
    assert meta["rap_schedule_iteration_ms"] == meta["simulated_iteration_ms"]["rap"]
    assert meta["predicted_iteration_ms"] == meta["whole_start_iteration_ms"]["emb_fwd"]
    assert meta["predicted_iteration_ms"] == min(meta["whole_start_iteration_ms"].values())
    assert meta["predicted_iteration_ms"] == corun.predicted_iteration_ms
    assert meta["simulated_iteration_ms"]["ideal"] == pytest.approx(sum(profile.stage_ms.values()), abs=1e-3)
    assert meta["predicted_iteration_ms"] >= meta["simulated_iteration_ms"]["ideal"]
    assert schedule["assignments"] and all(a["predicted_ms"] > 0 for a in schedule["assignments"])  # timed
    plan_run = TrackingStore().stage_runs("recforge_daily", "corun")["plan_resources"]
    assert {f"rap_capacity_ms.{s}" for s in STAGES} <= plan_run.data.metrics.keys()
    assert plan_run.data.metrics["rap_predicted_iteration_ms"] == pytest.approx(meta["predicted_iteration_ms"])
    arts = {a.path for a in TrackingStore().client.list_artifacts(plan_run.info.run_id, "rap")}
    assert {"rap/stage_profile.json", "rap/stage_profile.png", "rap/schedule.json", "rap/schedule.png"} <= arts

    worker = WorkerResult.load(recforge_home / "runs" / "recforge_daily" / "corun" / "train" / "worker")
    rap = worker.rap
    assert rap["steps"] == out.steps == 10  # 1200 rows in batches of 128
    assert rap["batches"] == 10 and rap["measured_iteration_ms"] > 0
    assert set(rap["kernel_ms_by_stage"]) <= {a["stage"] for a in schedule["assignments"]}
    run = TrackingStore().stage_runs("recforge_daily", "corun")["train"]
    m = run.data.metrics
    assert m["rap_predicted_iteration_ms"] == pytest.approx(meta["predicted_iteration_ms"])
    assert m["rap_measured_iteration_ms"] == pytest.approx(rap["measured_iteration_ms"])
    assert m["rap_predicted_over_measured_iteration"] == pytest.approx(
        m["rap_predicted_iteration_ms"] / m["rap_measured_iteration_ms"])
    assert "rap_stage_ms.mlp_bwd" in m and m["rap_measured_stage_sum_ms"] > 0
    arts = {a.path for a in TrackingStore().client.list_artifacts(run.info.run_id, "rap")}
    assert {"rap/schedule.json", "rap/schedule.png", "rap/schedule_measured.png", "rap/corun_summary.json"} <= arts
    # configured corun: recorded as such, with both predictions; the run page's Gantt and fused groups
    choice = planned.preprocessing
    assert (choice.requested, choice.mode, choice.reason) == ("corun", "corun", "configured")
    assert choice.predicted_corun_ms == corun.predicted_iteration_ms and choice.predicted_inline_ms > 0
    assert {t["lane"] for t in planned.rap_schedule["tasks"]} >= {"train", "preprocess"}
    assert charts.gantt(planned.rap_schedule)["bars"] and planned.fusion["launches"] == len(planned.fusion["groups"])
    assert out.preprocessing == "corun" and "kernels (measured)" in {t["lane"] for t in out.rap_schedule["tasks"]}
    assert m["preprocessing_predicted_step_ms"] == pytest.approx(choice.predicted_corun_ms)
    assert run.data.params["preprocessing_mode"] == "corun" and m["preprocessing_measured_step_ms"] > 0
    # co-run reads ahead itself: no prefetch thread whatever train.prefetch_steps says; what ran is recorded
    assert worker.prefetch_steps == 0 and run.data.tags["prefetch_steps"] == "0"
    assert run.data.params["train.prefetch_steps"] == "4"

    # preprocessing auto on the same job, cold (a profile folder of its own, empty): decided by the bound (co-run
    # could save at most the preprocessing's share of a step measured on one rank) or, when that does not settle
    # it, by profiling; both predictions and the reason recorded, and the train task runs the chosen mode (inline
    # and co-run train the same weights: the probe below)
    auto_profiles = recforge_home / "auto_profiles"
    auto_plan, auto = _run(_ctx(recforge_home, "auto", "auto", corun={"profile_dir": str(auto_profiles)}))
    choice = auto_plan.preprocessing
    assert choice.requested == "auto" and choice.mode in ("inline", "corun")
    assert choice.predicted_inline_ms > 0 and choice.predicted_corun_ms > 0
    runs = TrackingStore().stage_runs("recforge_daily", "auto")
    plan_run, train_run = runs["plan_resources"].data, runs["train"].data
    assert plan_run.params["preprocessing_requested"] == "auto" and plan_run.tags["preprocessing_mode"] == choice.mode
    assert plan_run.tags["preprocessing_reason"] == choice.reason
    assert plan_run.metrics["preprocessing_predicted_corun_ms"] == pytest.approx(choice.predicted_corun_ms)
    assert plan_run.metrics["preprocessing_predicted_inline_ms"] == pytest.approx(choice.predicted_inline_ms)
    bound = StepBound(plan_run.metrics["preprocessing_train_bound_ms"],
                      plan_run.metrics["preprocessing_predicted_inline_prep_ms"])
    assert choice.bound == (choose_by_bound("auto", bound) is not None)  # the bound decided exactly when it could
    stored = list(auto_profiles.glob("*.json"))
    if choice.bound:  # inline without profiling; the predictions are the bound's
        assert choice.mode == "inline" and choice.reason.endswith("not profiled") and not stored
        assert choice.predicted_corun_ms == pytest.approx(bound.train_lb_ms, abs=1e-3)
        assert choice.predicted_inline_ms == pytest.approx(bound.train_lb_ms + bound.inline_prep_ms, abs=1e-3)
        assert plan_run.tags["preprocessing_predicted_by"] == "bound"
        assert plan_run.metrics["preprocessing_profile_s"] == 0
    else:  # profiled (and stored for the next run), then predicted from the profile
        assert len(stored) == 1 and plan_run.metrics["preprocessing_profile_s"] > 0
        assert choice.reason.startswith("auto: corun predicted")
        assert plan_run.tags["preprocessing_predicted_by"] == "profile"
        assert (choice.mode == "corun") == (
            choice.predicted_corun_ms < choice.predicted_inline_ms * (1 - CORUN_MARGIN))
    assert auto.preprocessing == choice.mode == train_run.params["preprocessing_mode"]
    auto_worker = WorkerResult.load(recforge_home / "runs" / "recforge_daily" / "auto" / "train" / "worker")
    assert (auto_worker.rap is not None) == (choice.mode == "corun") == (auto_plan.corun is not None)
    assert (auto.rap_schedule is not None) == (choice.mode == "corun")
    assert auto.steps == out.steps
    # and with the whole training data preprocessed first (offline), to float tolerance (whole shards at once)
    _, offline = _run(_ctx(recforge_home, "offline", "offline"))
    assert offline.steps == out.steps
    probe = {k: torch.load(recforge_home / "runs" / "recforge_daily" / k / "train" / "worker" / "probe.pt")
             for k in ("corun", "auto", "offline")}
    assert torch.equal(probe["corun"]["logits"], probe["auto"]["logits"])
    torch.testing.assert_close(probe["offline"]["logits"], probe["auto"]["logits"], rtol=1e-4, atol=1e-5)
    off_run = TrackingStore().stage_runs("recforge_daily", "offline")["train"]
    assert off_run.data.metrics["offline_preprocess_s"] > 0
    # the preprocessed copy is gone once the job trained (it was there: its size is logged)
    assert off_run.data.metrics["offline_preprocessed_bytes"] > 0
    assert not (recforge_home / "runs" / "recforge_daily" / "offline" / "train" / "preprocessed").exists()


def test_corun_with_rap_mapping_on_two_workers(recforge_home):
    """corun.mapping: the plan task places the tables (mapping MILP) and schedules each rank's two jobs; the workers
    shard by those placements, preprocess their tables' ids over the global batch and never run the input
    all-to-all; every row is trained once."""
    from recforge.rap.mapping.worker_mapping import load_mapping

    planned, out = _run(_ctx(recforge_home, "mapped", "corun", workers=2))  # corun.mapping's default: true
    corun = planned.corun
    assert corun.mapping_path.endswith("corun_mapping.json")
    mapping = [load_mapping(corun.mapping_path, 2, r) for r in range(2)]
    tables = {t for t, _ in planned.tables}
    assert set(mapping[0].placements) == tables
    held = {r: {t for t, p in mapping[0].placements.items() if p.kind != "data_parallel" and r in p.ranks}
            for r in range(2)}
    for r, m in enumerate(mapping):
        jobs = {s.meta["job"]: s for s in m.schedules}
        assert "local" in jobs and ("global" in jobs) == bool(held[r])
        if held[r]:
            assert jobs["global"].meta["rows"] == 2 * 128 and jobs["local"].meta["rows"] == 128
    # the job was profiled on 2 processes, collectives included
    key = ProfileKey.of(ModelConfig(), planned.tables, 2, 128, "cpu")
    profile = StageProfile.load(recforge_home / "rap" / "profiles", key)
    assert corun.profile.origin == "profiled"
    assert profile.meta["profiled_world_size"] == 2 and profile.meta["single_process"] is False
    assert all(profile.stage_ms[s] > 0 for s in STAGES)
    assert corun.mapping.imbalance_after is not None
    assert corun.mapping.predicted_iteration_ms > 0
    worker = WorkerResult.load(recforge_home / "runs" / "recforge_daily" / "mapped" / "train" / "worker")
    rap = worker.rap["mapped"]
    assert rap["input_all_to_all_used"] is False
    assert set(rap["global_features"]) == held[0]
    assert {t: info.ranks for t, info in worker.sharding_plan.items()} == \
        {t: list(p.ranks) for t, p in mapping[0].placements.items()}
    # under the mapping a task is 2 global batches of 2 x 128 rows: per 600-row shard 512 + 88 -> 3 global batches
    assert worker.samples_per_epoch == [1200] and out.steps == 6
    assert worker.rap["batches"] == 6 and worker.rap["stages_opened_by_step"] > 0
    run = TrackingStore().stage_runs("recforge_daily", "mapped")["plan_resources"]
    assert "rap_mapping_imbalance_after" in run.data.metrics
    assert "preprocess: local" in {t["lane"] for t in planned.rap_schedule["tasks"]}  # rank 0's two jobs
    train_metrics = TrackingStore().stage_runs("recforge_daily", "mapped")["train"].data.metrics
    assert train_metrics["rap_mapping_imbalance_after"] == pytest.approx(corun.mapping.imbalance_after)
    assert train_metrics["preprocessing_predicted_step_ms"] == pytest.approx(corun.mapping.predicted_iteration_ms)
    arts = {a.path for a in TrackingStore().client.list_artifacts(run.info.run_id, "rap")}
    assert {"rap/corun_mapping.json", "rap/schedule_rank0_local.png"} <= arts
