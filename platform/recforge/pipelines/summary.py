"""The end-of-run summary `make demo` prints, read from the stages' recorded outputs."""
from __future__ import annotations

from typing import Any

from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import (
    CompileOutputs,
    EvaluateOutputs,
    GenerateOutputs,
    IngestOutputs,
    PublishOutputs,
    TrainOutputs,
)


def summarize(ctx: RunContext) -> dict[str, Any]:
    gen, ing, tr = ctx.read(GenerateOutputs), ctx.read(IngestOutputs), ctx.read(TrainOutputs)
    ev, comp, pub = ctx.read(EvaluateOutputs), ctx.read(CompileOutputs), ctx.read(PublishOutputs)
    rep = comp.report
    return {
        "run_key": ctx.run_key,
        "rows_ingested": ing.rows_ingested,
        "rows_quarantined": ing.rows_quarantined,
        "train_samples_per_s": tr.samples_per_s,
        "train_world_size": tr.world_size,
        "train_wall_s": tr.wall_s,
        "holdout_auc": ev.auc,
        "holdout_logloss": ev.logloss,
        "holdout_ne": ev.ne,
        "auc_ceiling": ev.auc_ceiling or (gen.bayes_auc[-1] if gen.bayes_auc else None),
        "eager_latency_ms": rep.eager_median_ms,
        "compiled_latency_ms": rep.compiled_median_ms,
        "compile_speedup": rep.speedup,
        "compile_max_abs_diff": rep.max_abs_diff,
        "compile_backend": rep.backend,
        "pipeline_run_id": pub.pipeline_run_id,
        "model": f"{pub.model_name} v{pub.version}",
        "champion": pub.promoted,
        "promotion": pub.reason,
    }
