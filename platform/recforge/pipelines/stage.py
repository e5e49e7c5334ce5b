"""Run one stage under its MLflow child run, with atomic outputs; a failure closes the stage's run and the
pipeline's parent run as FAILED with the reason (tags recforge.error, recforge.error_kind)."""
from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from recforge.elastic.shutdown import JobCancelled
from recforge.elastic.shutdown import sigterm_raises as _sigterm_raises
from recforge.pipelines.context import RunContext, StageWriter
from recforge.pipelines.outputs import OutputsError, OutputsT

log = logging.getLogger("recforge.pipelines")


class InvalidInput(ValueError):
    """Bad input that a retry cannot fix (raise it before the stage's work starts): the Airflow task fails at once."""


class StageCancelled(JobCancelled):
    """SIGTERM reached the stage's process: Airflow marked the task failed or cancelled it, or its pod is stopping.
    A BaseException (as JobCancelled, which a training job inside the stage raises), so `except Exception` blocks on
    the way out do not swallow it."""


# Failures a retry cannot fix: bad Params/config, a record that does not hold its schema, InvalidInput. Everything
# else (a worker crash, OSError, a timeout) may be transient and is retried while attempts remain.
INVALID_INPUT: tuple[type[BaseException], ...] = (InvalidInput, ValidationError, OutputsError)


_RECORDED = "_recforge_failure_recorded"


def mark_recorded(exc: BaseException) -> None:
    """Note on `exc` that its failure is in MLflow already (so callers up the stack do not record it again)."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _RECORDED, True)


def is_recorded(exc: BaseException) -> bool:
    return bool(getattr(exc, _RECORDED, False))


def is_data_error(exc: BaseException) -> bool:
    """A recforge.data.errors.DataError: the input data's fault, not the code's. Checked without importing
    recforge.data (its package pulls pyarrow onto the DAG-parse path): an instance means the module is loaded."""
    cls = getattr(sys.modules.get("recforge.data.errors"), "DataError", None)
    return isinstance(cls, type) and isinstance(exc, cls)


_DATA_LOGGED = "_recforge_data_error_logged"


def log_data_error(exc: BaseException) -> None:
    """Log a DataError's one line, `DATA ERROR: ...`, once per exception: the first line of the failure in the task
    log, before any traceback. Anything else: nothing."""
    if not is_data_error(exc) or getattr(exc, _DATA_LOGGED, False):
        return
    one_line = getattr(exc, "one_line", None)
    log.error("DATA ERROR: %s", one_line() if callable(one_line) else " ".join(str(exc).split()))
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _DATA_LOGGED, True)


def failure_kind(exc: BaseException) -> str:
    """The ERROR_KIND_TAG value of a failure: cancelled, data (a DataError: the input data is bad; no retry),
    invalid_input (no retry) or error (a code or environment error; retried). (The DAG's failure callback adds
    `killed`: a process that died without closing its run.)"""
    if isinstance(exc, (JobCancelled, KeyboardInterrupt)):
        return "cancelled"
    if is_data_error(exc):
        return "data"
    if isinstance(exc, INVALID_INPUT):
        return "invalid_input"
    return "error"


def failure_reason(exc: BaseException) -> BaseException | str:
    """What the FAILED run records: the exception, or for a signal 'cancelled/killed (SIGTERM)'."""
    if isinstance(exc, JobCancelled):
        return f"cancelled/killed (SIGTERM): {exc}"
    if isinstance(exc, KeyboardInterrupt):
        return "cancelled/killed (SIGINT)"
    return exc


def sigterm_raises() -> contextlib.AbstractContextManager[None]:
    """While the stage runs, SIGTERM raises StageCancelled in it (once), after the handler it replaces ran.

    Airflow 3's task runner answers SIGTERM only with the operator's on_kill() and SIGKILLs the process 5 s later, so
    without this a cancelled task would leave its MLflow runs RUNNING. The mechanism is the training job's
    (recforge.elastic.shutdown): one per process, a training job inside the stage stops its workers and relaunches
    nothing. Only the main thread can own a handler; in another thread (or a process forked from this one) nothing
    changes."""
    return _sigterm_raises(StageCancelled, "the task process received SIGTERM (marked failed or cancelled in Airflow, "
                                           "or its worker is stopping)")


def run_stage(ctx: RunContext, model: type[OutputsT],
              body: Callable[[StageWriter, Any, str], OutputsT]) -> OutputsT:
    """Run `body(writer, store, run_id)` as stage `model.stage`; commit the `model` it returns (with the MLflow run
    id filled in) and return it as recorded. On any failure (SIGTERM included) the stage's run and the parent run
    end FAILED with the reason, and the exception propagates."""
    from recforge.tracking import TrackingStore  # lazy: mlflow off the CLI/DAG import path

    stage = model.stage
    store = TrackingStore(ctx.tracking_uri)
    parent_id = store.pipeline_run(ctx.experiment, ctx.run_key)
    store.log_params(parent_id, ctx.config.model_dump(mode="json"))
    run_id = store.stage_run(ctx.experiment, ctx.run_key, stage)
    writer = StageWriter(ctx, stage)
    try:
        with sigterm_raises():
            outputs = body(writer, store, run_id)
            if not isinstance(outputs, model):
                raise TypeError(f"stage {stage!r} returned {type(outputs).__name__}, not {model.__name__}")
            outputs = writer.commit(outputs.model_copy(update={"mlflow_run_id": run_id}))
    except BaseException as e:
        log_data_error(e)  # first, before anything else about the failure
        writer.abort()
        kind, reason = failure_kind(e), failure_reason(e)
        log.error("stage %s of %s failed (%s): %s", stage, ctx.run_key, kind, reason)
        try:
            store.finish(run_id, ok=False, error=reason, kind=kind)
            store.fail_pipeline(ctx.experiment, ctx.run_key, stage, reason, kind=kind)
            mark_recorded(e)
        except Exception:  # the stage's own failure is what propagates, not MLflow's trouble recording it
            log.exception("stage %s of %s: could not record the failure in MLflow", stage, ctx.run_key)
        raise
    store.finish(run_id, ok=True)
    scalars = {k: v for k, v in outputs.model_dump(mode="json").items() if not isinstance(v, (dict, list))}
    log.info("stage %s of %s done: %s", stage, ctx.run_key, scalars)
    return outputs
