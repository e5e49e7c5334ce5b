"""Compile the trained model for inference (RECom seam) and publish it to the MLflow registry."""
from __future__ import annotations

from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import CompileOutputs, CompileReport, EvaluateOutputs, IngestOutputs, PublishOutputs
from recforge.pipelines.stage import run_stage
from recforge.pipelines.stages.train import load_trained

REGISTERED_MODEL = "recforge-dlrm"


def _holdout_inputs(ctx: RunContext, rows: int):
    """The first `rows` held-out rows (fewer when the day has fewer), read across as many shards as needed."""
    import pyarrow as pa  # lazy: pyarrow off the CLI/DAG import path

    from recforge.data.shards import open_manifest, read_rows  # lazy: pyarrow (as above)
    from recforge.preprocess.batch import RawBatch  # lazy: torch off the CLI/DAG import path

    manifest_dir = ctx.read(IngestOutputs).holdout.manifest_dir
    batches = []
    for i, shard in enumerate(open_manifest(manifest_dir).shards):
        if rows <= 0:
            break
        take = min(rows, shard.rows)
        batches.append(read_rows(manifest_dir, i, 0, take))
        rows -= take
    if not batches or sum(b.num_rows for b in batches) == 0:
        raise ValueError(f"compile: the held-out day at {manifest_dir} has no rows to compile and check against")
    table = pa.Table.from_batches(batches).combine_chunks()
    raw = RawBatch.from_arrow(table.to_batches()[0], ctx.config.dataset())
    return (raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid)


def compile_model(ctx: RunContext) -> CompileOutputs:
    def body(w, store, run_id):
        import recforge.recom as recom  # lazy: torch off the CLI/DAG import path (so are the three below)
        from recforge.preprocess.module import PreprocessModule  # lazy: torch
        from recforge.recom.inference import InferenceModule  # lazy: torch
        from recforge.recom.report import compile_report  # lazy: torch

        model, plan = load_trained(ctx)
        eager = InferenceModule(PreprocessModule(plan, ctx.config.dataset()), model).eval()
        example = _holdout_inputs(ctx, 256)
        compiled = recom.compile(eager.lowered(), example)
        check_inputs = _holdout_inputs(ctx, 2048)
        report = CompileReport.model_validate(compile_report(eager, compiled, check_inputs))
        path = w.tmp / "inference.pt2"
        compiled.save(path)
        recorded = report.model_dump(mode="json")
        store.log_metrics(run_id, {k: v for k, v in recorded.items() if isinstance(v, (int, float))})
        store.log_dict(run_id, recorded, "compile_report.json")
        store.log_artifact(run_id, path)
        from recforge.recom.serving import register_compiled  # lazy: torch, mlflow off the CLI/DAG import path

        compiled_version = None
        if report.within_tolerance:  # registered (as <trained>-compiled) only when it matched eager
            compiled_version = register_compiled(store, run_id, path, REGISTERED_MODEL,
                                                 max_abs_diff=report.max_abs_diff, atol=report.atol)
        return CompileOutputs(artifact=str(w.final / "inference.pt2"), report=report,
                              compiled_version=compiled_version)

    return run_stage(ctx, CompileOutputs, body)


def publish(ctx: RunContext) -> PublishOutputs:
    quality = ctx.read(EvaluateOutputs)
    compiled = ctx.read(CompileOutputs)

    def body(w, store, run_id):
        from recforge.tracking import ModelRegistry  # lazy: mlflow off the CLI/DAG import path

        model, _ = load_trained(ctx)
        registry = ModelRegistry(store, REGISTERED_MODEL)
        store.log_artifact(run_id, compiled.artifact, "compiled")
        version = registry.log_and_register(
            run_id, model, auc=quality.auc,
            tags={"run_key": ctx.run_key, "compiled_artifact": "compiled/inference.pt2"},
        )
        decision = registry.promote_if_not_worse(version, quality.auc, ctx.config.champion_margin)
        parent = store.pipeline_run(ctx.experiment, ctx.run_key)
        store.log_metrics(parent, {"auc": quality.auc, "logloss": quality.logloss,
                                   "promoted": float(decision.promoted)})
        store.set_tags(parent, {"model_version": version, "champion": decision.promoted})
        return PublishOutputs(model_name=REGISTERED_MODEL, version=version, promoted=decision.promoted,
                              reason=decision.reason, pipeline_run_id=parent)

    out = run_stage(ctx, PublishOutputs, body)
    from recforge.tracking import TrackingStore  # lazy: mlflow off the CLI/DAG import path

    store = TrackingStore(ctx.tracking_uri)
    store.finish(out.pipeline_run_id, ok=True)
    return out
