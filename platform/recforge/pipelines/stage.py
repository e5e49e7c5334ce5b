"""Run one stage under its MLflow child run, with atomic outputs."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from recforge.pipelines.context import RunContext, StageWriter
from recforge.pipelines.outputs import OutputsT

log = logging.getLogger("recforge.pipelines")


def run_stage(ctx: RunContext, model: type[OutputsT],
              body: Callable[[StageWriter, Any, str], OutputsT]) -> OutputsT:
    """Run `body(writer, store, run_id)` as stage `model.stage`; commit the `model` it returns (with the MLflow run
    id filled in) and return it as recorded."""
    from recforge.tracking import TrackingStore  # lazy: mlflow off the CLI/DAG import path

    stage = model.stage
    store = TrackingStore(ctx.tracking_uri)
    parent_id = store.pipeline_run(ctx.experiment, ctx.run_key)
    store.log_params(parent_id, ctx.config.model_dump(mode="json"))
    run_id = store.stage_run(ctx.experiment, ctx.run_key, stage)
    writer = StageWriter(ctx, stage)
    try:
        outputs = body(writer, store, run_id)
        if not isinstance(outputs, model):
            raise TypeError(f"stage {stage!r} returned {type(outputs).__name__}, not {model.__name__}")
        outputs = writer.commit(outputs.model_copy(update={"mlflow_run_id": run_id}))
    except BaseException:
        writer.abort()
        store.finish(run_id, ok=False)
        raise
    store.finish(run_id, ok=True)
    scalars = {k: v for k, v in outputs.model_dump(mode="json").items() if not isinstance(v, (dict, list))}
    log.info("stage %s of %s done: %s", stage, ctx.run_key, scalars)
    return outputs
