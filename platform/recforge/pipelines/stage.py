"""Run one stage under its MLflow child run, with atomic outputs."""
from __future__ import annotations

import logging
from typing import Any, Callable

from recforge.pipelines.context import RunContext, StageWriter

log = logging.getLogger("recforge.pipelines")


def run_stage(ctx: RunContext, stage: str, body: Callable[[StageWriter, Any, str], dict[str, Any]]) -> dict[str, Any]:
    from recforge.tracking import TrackingStore

    store = TrackingStore(ctx.tracking_uri)
    parent_id = store.pipeline_run(ctx.experiment, ctx.run_key)
    store.log_params(parent_id, ctx.config.model_dump(mode="json"))
    run_id = store.stage_run(ctx.experiment, ctx.run_key, stage)
    writer = StageWriter(ctx, stage)
    try:
        outputs = body(writer, store, run_id)
        outputs = writer.commit({**outputs, "mlflow_run_id": run_id})
    except BaseException:
        writer.abort()
        store.finish(run_id, ok=False)
        raise
    store.finish(run_id, ok=True)
    log.info("stage %s of %s done: %s", stage, ctx.run_key, {k: v for k, v in outputs.items() if not isinstance(v, (dict, list))})
    return outputs
