"""Continuous training and the fair champion gate, end to end on tiny data with one worker.

Day 1 runs the whole pipeline from scratch and becomes the champion. Day 2 is a scheduled run (train.warm_start
'auto'): it starts from the champion's checkpoint, and its evaluate task scores the champion on day 2's held-out day
too. A from-scratch run on the very same day-2 data is the comparison: the warm-started model's AUC on the next day
is at least the from-scratch one's, and both evaluate tasks scored the champion identically (same day, same model).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CONF = {"rows_per_day": 3000, "rows_per_shard": 1500, "seed": 5, "table_cap": 500, "train_days": 1,
        "preprocessing": "inline", "champion_min_rows": 1000, "champion_min_auc": 0.55,
        "train": {"batch_size": 64, "log_every": 5, "batches_per_task": 4},
        "model": {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 1]},
        "resources": {"workers": 1, "policy": "static"},
        "checkpoint": {"every_steps": 0, "flash": False},
        "compile_backend": "export"}  # the subject is warm start, not RECom's C++ build
DAY = 739_000  # data_day of day 1; day 2 is the next calendar day


def test_second_day_warm_starts_from_the_champion_and_is_no_worse_than_scratch(recforge_home):
    from recforge.pipelines.context import RunContext
    from recforge.pipelines.runner import run_all
    from recforge.pipelines.stages.data import generate, ingest
    from recforge.pipelines.stages.evaluate import NonFiniteModelError, evaluate
    from recforge.pipelines.stages.plan import plan_resources
    from recforge.pipelines.stages.serve import publish
    from recforge.pipelines.stages.train import train
    from recforge.tracking import TrackingStore

    day1 = RunContext.create("scheduled__day1", CONF, home=recforge_home, data_day=DAY, run_type="scheduled")
    first = run_all(day1)
    assert not first["train"].warm_start.used and "no champion yet" in first["train"].warm_start.reason
    assert first["evaluate"].champion is None and first["evaluate"].champion_version is None
    published = first["publish"]
    assert published.promoted and "no champion yet" in published.reason and published.champion_auc is None
    v1 = published.version
    report = first["compile"].report  # what ran is recorded: the requested backend, no fallback
    assert (report.backend, report.model_extra["requested_backend"]) == ("export", "export"), report

    # day 2, scheduled: 'auto' warm-starts from the champion (same schema, plan, model, optimizer)
    day2 = RunContext.create("scheduled__day2", CONF, home=recforge_home, data_day=DAY + 1, run_type="scheduled")
    for stage in (generate, ingest, plan_resources):
        stage(day2)
    warm = train(day2)
    assert warm.warm_start.used and warm.warm_start.champion_version == v1, warm.warm_start
    assert warm.warm_start.checkpoint == first["train"].checkpoint_dir
    assert "loaded by the workers" in warm.warm_start.reason
    warm_eval = evaluate(day2)

    # the same day-2 data, trained from scratch (a manual run: 'auto' means scratch)
    scratch_ctx = RunContext.create("manual__day2", CONF, home=recforge_home, data_day=DAY + 1)
    for stage in ("generate", "ingest", "plan_resources"):  # the very same shards and plan as day 2
        shutil.copytree(day2.stage_dir(stage), scratch_ctx.stage_dir(stage))
    scratch = train(scratch_ctx)
    assert not scratch.warm_start.used and "manual run trains from scratch" in scratch.warm_start.reason
    scratch_eval = evaluate(scratch_ctx)

    # fair gate: the champion is scored on the challenger's own held-out day, the same in both runs
    for ev in (warm_eval, scratch_eval):
        assert ev.champion is not None and ev.champion.version == v1 and ev.champion.rows == ev.rows >= 1000
    assert warm_eval.champion.auc == pytest.approx(scratch_eval.champion.auc, abs=1e-9)
    assert warm_eval.champion.auc != pytest.approx(first["evaluate"].auc, abs=1e-6)  # another day than day 1's

    print(f"next-day AUC: warm-started {warm_eval.auc:.4f}, from scratch {scratch_eval.auc:.4f}, "
          f"champion (day-1 model) {warm_eval.champion.auc:.4f}")
    assert warm_eval.auc >= scratch_eval.auc

    # the weights really came from the champion: the first logged training window already has a lower loss
    store = TrackingStore()
    first_loss = {name: min(store.client.get_metric_history(out.mlflow_run_id, "train_loss"),
                            key=lambda m: m.step).value for name, out in (("warm", warm), ("scratch", scratch))}
    assert first_loss["warm"] < first_loss["scratch"], first_loss
    tags = store.client.get_run(warm.mlflow_run_id).data.tags
    assert tags["warm_start.used"] == "True" and tags["warm_start.champion_version"] == v1
    assert store.client.get_run(warm_eval.mlflow_run_id).data.metrics["champion_auc"] == pytest.approx(
        warm_eval.champion.auc)

    # a model with NaN weights (its checkpoint intact by its checksums): evaluate fails naming it, records no
    # outputs, its MLflow run is FAILED, so publish has nothing to promote
    nan_ctx = RunContext.create("manual__day2_nan", CONF, home=recforge_home, data_day=DAY + 1)
    for stage in ("generate", "ingest", "plan_resources", "train"):
        shutil.copytree(scratch_ctx.stage_dir(stage), nan_ctx.stage_dir(stage))
    outputs = nan_ctx.stage_dir("train") / "outputs.json"
    outputs.write_text(outputs.read_text().replace(str(scratch_ctx.run_dir), str(nan_ctx.run_dir)))
    _poison(nan_ctx)
    with pytest.raises(NonFiniteModelError, match=r"logits are not finite on (\d+) of \1 rows"):
        evaluate(nan_ctx)
    assert not (nan_ctx.stage_dir("evaluate") / "outputs.json").exists()
    assert store.stage_runs(nan_ctx.experiment, nan_ctx.run_key)["evaluate"].info.status == "FAILED"
    with pytest.raises(FileNotFoundError, match="evaluate"):
        publish(nan_ctx)


def _poison(ctx):
    """Overwrite the final checkpoint with NaN dense weights, re-checksummed (as a NaN-diverged run would save it)."""
    import json

    import torch
    import torch.distributed.checkpoint as dcp

    from recforge.pipelines.outputs import PlanOutputs, TrainOutputs
    from recforge.train.recovery.checkpoint import load_unsharded
    from recforge.train.recovery.layout import CHECKSUMS_FILE, META_FILE, write_checksums

    plan, ckpt = ctx.read(PlanOutputs), Path(ctx.read(TrainOutputs).checkpoint_dir)
    model = load_unsharded(ctx.config.model, plan.tables, plan.num_dense, ckpt)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embedding" not in name:
                p.fill_(float("nan"))
    meta = json.loads((ckpt / META_FILE).read_text())
    shutil.rmtree(ckpt)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / META_FILE).write_text(json.dumps(meta))
    write_checksums(ckpt)
    assert (ckpt / CHECKSUMS_FILE).exists()
