"""The daily pipeline's train task with `preprocessing: corun` (raw shards in, RAP co-running in the workers, the
schedule and predicted vs measured iteration time in MLflow) and `offline` (the training data preprocessed first):
same seeds, same model as inline preprocessing."""
from __future__ import annotations

import json

import pytest
import torch

from recforge.config import ModelConfig
from recforge.pipelines.context import RunContext
from recforge.pipelines.stages.data import generate, ingest
from recforge.pipelines.stages.plan import plan_resources
from recforge.pipelines.stages.train import train
from recforge.rap.profiling.profiler import ProfileKey, StageProfile
from recforge.rap.profiling.stages import STAGES
from recforge.tracking import TrackingStore
from recforge.train.result import WorkerResult

pytestmark = pytest.mark.slow


def _ctx(home, key, preprocessing, workers=1):
    cfg = {"rows_per_day": 1200, "rows_per_shard": 600, "seed": 3, "table_cap": 500, "preprocessing": preprocessing,
           "resources": {"workers": workers}, "train": {"batch_size": 128, "log_every": 2, "batches_per_task": 2}}
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
    assert meta["source"] == f"RAP scheduler over stage profile {key.slug()}"  # not the one-stage fallback
    assert meta["stage_ms"] == profile.stage_ms and meta["capacity_ms"] == profile.capacity_ms
    assert meta["predicted_iteration_ms"] == corun.predicted_iteration_ms == meta["simulated_iteration_ms"]["rap"]
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

    # the same job with inline preprocessing trains to the same weights (the co-run ids are the ones consumed)
    _, inline = _run(_ctx(recforge_home, "inline", "inline"))
    assert inline.steps == out.steps
    # and with the whole training data preprocessed first (offline), to float tolerance (whole shards at once)
    _, offline = _run(_ctx(recforge_home, "offline", "offline"))
    assert offline.steps == out.steps
    probe = {k: torch.load(recforge_home / "runs" / "recforge_daily" / k / "train" / "worker" / "probe.pt")
             for k in ("corun", "inline", "offline")}
    assert torch.equal(probe["corun"]["logits"], probe["inline"]["logits"])
    torch.testing.assert_close(probe["offline"]["logits"], probe["inline"]["logits"], rtol=1e-4, atol=1e-5)
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
    arts = {a.path for a in TrackingStore().client.list_artifacts(run.info.run_id, "rap")}
    assert {"rap/corun_mapping.json", "rap/schedule_rank0_local.png"} <= arts
