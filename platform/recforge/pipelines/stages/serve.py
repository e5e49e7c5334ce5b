"""Compile the trained model for inference (RECom seam) and publish it to the MLflow registry."""
from __future__ import annotations

import logging

from recforge.pipelines.context import RunContext
from recforge.pipelines.hooks import warm_start
from recforge.pipelines.hooks.warm_start import REGISTERED_MODEL
from recforge.pipelines.outputs import (
    CompileOutputs,
    CompileReport,
    EvaluateOutputs,
    IngestOutputs,
    PlanOutputs,
    PublishOutputs,
    TrainOutputs,
)
from recforge.pipelines.stage import run_stage
from recforge.pipelines.stages.evaluate import PLAN_ARTIFACT, log_champion, score_champion
from recforge.pipelines.stages.train import load_trained

log = logging.getLogger("recforge.pipelines")

GATE_ATTEMPTS = 3  # the champion may move under a publish (another run promoted): rescored this often


def _holdout_inputs(ctx: RunContext, rows: int, list_columns: list[str] | None = None):
    """The first `rows` held-out rows (fewer when the day has fewer), read across as many shards as needed, as the
    inference model's inputs: (dense, dense_valid, sparse, sparse_valid), plus a jagged dict {"<column>": values,
    "<column>_lengths": lengths} when `list_columns` (the multi-hot columns the plan reads) is not empty."""
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
    if not list_columns:
        return (raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid)
    jagged = {}
    for name in list_columns:
        col = raw.jagged[name]
        if not bool(col.valid.all()):  # ingest quarantines rows with a null inside a list
            raise ValueError(f"compile: held-out multi_hot column {name!r} at {manifest_dir} has null elements "
                             f"inside lists ({int((~col.valid).sum())}); the serving input takes none: re-ingest")
        jagged[name], jagged[name + "_lengths"] = col.values, col.lengths
    return (raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid, jagged)


def compile_model(ctx: RunContext) -> CompileOutputs:
    def body(w, store, run_id):
        import recforge.recom as recom  # lazy: torch off the CLI/DAG import path (so are the three below)
        from recforge.preprocess.module import PreprocessModule  # lazy: torch
        from recforge.recom.inference import InferenceModule  # lazy: torch
        from recforge.recom.report import compile_report  # lazy: torch

        model, plan = load_trained(ctx)
        eager = InferenceModule(PreprocessModule(plan, ctx.config.dataset()), model).eval()
        lists = eager.preprocess.list_columns  # multi-hot columns: a jagged input (docs/recom.md#multi-hot-columns)
        example = _holdout_inputs(ctx, 256, lists)
        compiled = recom.compile(eager.lowered(), example, backend=ctx.config.compile_backend)
        check_inputs = _holdout_inputs(ctx, 2048, lists)
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
    """Register the model (with its plan, compiled form and what warm start needs) and promote it when the gate
    passes against the champion scored on the same held-out day (recforge.tracking.registry.gate)."""
    quality = ctx.read(EvaluateOutputs)
    compiled = ctx.read(CompileOutputs)
    plan = ctx.read(PlanOutputs)
    trained = ctx.read(TrainOutputs)
    cfg = ctx.config

    def body(w, store, run_id):
        from recforge.tracking.registry import (  # lazy: mlflow off the CLI/DAG import path
            ChampionChangedError,
            ModelRegistry,
        )

        model, _ = load_trained(ctx)
        registry = ModelRegistry(store, REGISTERED_MODEL)
        store.log_artifact(run_id, compiled.artifact, "compiled")
        store.log_artifact(run_id, plan.plan_path, PLAN_ARTIFACT.rsplit("/", 1)[0])  # the champion is scored with it
        version = registry.log_and_register(
            run_id, model, auc=quality.auc,
            tags={"compiled_artifact": "compiled/inference.pt2",
                  **warm_start.registration_tags(ctx, plan, trained.checkpoint_dir)},  # what warm start checks
        )
        champ_version, score, problem = quality.champion_version, quality.champion, quality.champion_problem
        for attempt in range(GATE_ATTEMPTS):
            try:
                decision = registry.promote(
                    version, auc=quality.auc, rows=quality.rows, champion_version=champ_version,
                    champion_auc=score.auc if score is not None else None, champion_problem=problem,
                    margin=cfg.champion_margin, min_auc=cfg.champion_min_auc, min_rows=cfg.champion_min_rows)
                break
            except ChampionChangedError as e:  # evaluate scored another champion: score the new one on the same day
                if attempt == GATE_ATTEMPTS - 1:
                    raise
                log.warning("publish: %s; scoring the new champion on the same held-out day", e)
                champ_version, score, problem = score_champion(ctx, store, w.tmp / f"champion-{attempt}")
        log_champion(store, run_id, champ_version, score, problem)
        champion_auc = score.auc if score is not None and champ_version != version else None
        gate = {"challenger_auc": quality.auc, "promoted": float(decision.promoted),
                **({"champion_auc": champion_auc} if champion_auc is not None else {})}
        store.log_metrics(run_id, gate)
        tags = {"model_version": version, "champion": decision.promoted, "promotion.reason": decision.reason[:5000],
                "promotion.champion_version": champ_version or "none"}
        store.set_tags(run_id, tags)
        parent = store.pipeline_run(ctx.experiment, ctx.run_key)
        store.log_metrics(parent, {"auc": quality.auc, "logloss": quality.logloss, **gate})
        store.set_tags(parent, tags)
        log.info("publish: v%s %s: %s", version, "promoted" if decision.promoted else "not promoted", decision.reason)
        return PublishOutputs(model_name=REGISTERED_MODEL, version=version, promoted=decision.promoted,
                              reason=decision.reason, challenger_auc=quality.auc, champion_auc=champion_auc,
                              champion_version=champ_version, pipeline_run_id=parent)

    out = run_stage(ctx, PublishOutputs, body)
    from recforge.tracking import TrackingStore  # lazy: mlflow off the CLI/DAG import path

    store = TrackingStore(ctx.tracking_uri)
    store.finish(out.pipeline_run_id, ok=True)
    return out
