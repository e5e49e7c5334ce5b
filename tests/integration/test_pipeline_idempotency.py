"""A retried stage overwrites its own outputs and reuses its MLflow run."""
import json

from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import IngestOutputs
from recforge.pipelines.stages.data import generate, ingest
from recforge.pipelines.stages.plan import plan_resources
from recforge.tracking import TrackingStore


def _tiny(home):
    return RunContext.create("manual__2026-11-29T00:00:00+00:00",
                             {"rows_per_day": 3000, "rows_per_shard": 1000, "seed": 3}, home=home)


def test_stages_are_idempotent(recforge_home):
    ctx = _tiny(recforge_home)
    first = {"generate": generate(ctx), "ingest": ingest(ctx), "plan": plan_resources(ctx)}
    manifest_before = (ctx.stage_dir("ingest") / "train" / "manifest.json").read_text()

    second = {"generate": generate(ctx), "ingest": ingest(ctx), "plan": plan_resources(ctx)}
    manifest_after = (ctx.stage_dir("ingest") / "train" / "manifest.json").read_text()

    assert json.loads(manifest_before)["shards"] == json.loads(manifest_after)["shards"]
    assert first["ingest"].train.rows == second["ingest"].train.rows == 3000
    assert second["ingest"].holdout.rows == 3000
    assert ctx.read(IngestOutputs) == second["ingest"]  # what the stage returned is what a later stage reads
    assert len(list((ctx.stage_dir("ingest") / "train").glob("part-*.parquet"))) == 3
    # one MLflow run per stage plus the parent, each reused by the retry
    runs = TrackingStore().stage_runs(ctx.experiment, ctx.run_key)
    assert sorted(runs) == ["generate", "ingest", "pipeline", "plan_resources"]
    assert first["ingest"].mlflow_run_id == second["ingest"].mlflow_run_id is not None
    parent = runs["pipeline"].info.run_id
    assert all(r.data.tags.get("mlflow.parentRunId") == parent for s, r in runs.items() if s != "pipeline")
    # no temp directories left behind
    assert not [p for p in ctx.run_dir.iterdir() if p.name.startswith(".")]


def test_a_failed_stage_leaves_no_outputs(recforge_home, tmp_path):
    ctx = RunContext.create("bad", {"rows_per_day": 1000, "source_uri": str(tmp_path / "missing" / "day_{ds}.tsv")},
                            home=recforge_home, data_day=739_000)
    import pytest

    with pytest.raises(FileNotFoundError, match="no landing file for day"):
        generate(ctx)
    assert not (ctx.stage_dir("generate") / "outputs.json").exists()
    assert not ctx.stage_dir("generate").exists()
    run = TrackingStore().stage_runs(ctx.experiment, ctx.run_key)["generate"]
    assert run.info.status == "FAILED"
