"""The end-of-run summary `make demo` prints, read from the stages' recorded outputs."""
from __future__ import annotations

from typing import Any

from recforge.pipelines.context import RunContext


def summarize(ctx: RunContext) -> dict[str, Any]:
    gen, ing, tr = ctx.outputs("generate"), ctx.outputs("ingest"), ctx.outputs("train")
    ev, comp, pub = ctx.outputs("evaluate"), ctx.outputs("compile"), ctx.outputs("publish")
    rep = comp["report"]
    return {
        "run_key": ctx.run_key,
        "rows_ingested": ing["rows_ingested"],
        "rows_quarantined": ing["rows_quarantined"],
        "train_samples_per_s": tr["samples_per_s"],
        "train_world_size": tr["world_size"],
        "train_wall_s": tr["wall_s"],
        "holdout_auc": ev["auc"],
        "holdout_logloss": ev["logloss"],
        "holdout_ne": ev.get("ne"),
        "auc_ceiling": ev.get("auc_ceiling") or (gen.get("bayes_auc") or [None])[-1],
        "eager_latency_ms": rep.get("eager_median_ms"),
        "compiled_latency_ms": rep.get("compiled_median_ms"),
        "compile_speedup": rep.get("speedup"),
        "compile_max_abs_diff": rep.get("max_abs_diff"),
        "compile_backend": rep.get("backend"),
        "pipeline_run_id": pub["pipeline_run_id"],
        "model": f"{pub['model_name']} v{pub['version']}",
        "champion": pub["promoted"],
        "promotion": pub["reason"],
    }
