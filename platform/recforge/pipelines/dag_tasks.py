"""Glue between Airflow's task context and the stage functions (keeps DAG files to wiring only): the DAG's Params
read off PipelineConfig, the run's conf checked against them, invalid input failed without a retry, each task's
execution_timeout (`stage_timeout`).

`python -m recforge.pipelines.dag_tasks --markdown` prints the Params table of the README."""
from __future__ import annotations

import argparse
import logging
import os
import types
from datetime import UTC, date, timedelta
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from recforge.config import PipelineConfig
from recforge.config.pipeline import JOB_TIMEOUT_S
from recforge.pipelines.context import EXPERIMENT, RunContext, run_key_from
from recforge.pipelines.stage import (
    INVALID_INPUT,
    InvalidInput,
    failure_kind,
    failure_reason,
    is_data_error,
    is_recorded,
    log_data_error,
    sigterm_raises,
)

log = logging.getLogger("recforge.pipelines")

# Param name -> PipelineConfig field path: the one table the DAG's Params, their validation and the README's options
# table are built from. Airflow 3 TaskFlow reserves `run_id`, so none is used here.
PARAM_FIELDS: dict[str, tuple[str, ...]] = {
    "dataset_schema": ("dataset_schema",),
    "source_uri": ("source_uri",),
    "ready_marker": ("ready_marker",),
    "holdout": ("holdout",),
    "holdout_fraction": ("holdout_fraction",),
    "sensor_timeout_s": ("sensor_timeout_s",),
    "sensor_poke_s": ("sensor_poke_s",),
    "rows_per_day": ("rows_per_day",),
    "train_days": ("train_days",),
    "seed": ("seed",),
    "table_cap": ("table_cap",),
    "hash_headroom": ("hash_headroom",),
    "model_arch": ("model", "arch"),
    "epochs": ("train", "epochs"),
    "batch_size": ("train", "batch_size"),
    "warm_start": ("train", "warm_start"),
    "embedding_optimizer": ("train", "embedding_optimizer"),
    "embedding_lr": ("train", "embedding_lr"),
    "dense_optimizer": ("train", "dense_optimizer"),
    "dense_lr": ("train", "dense_lr"),
    "prefetch_steps": ("train", "prefetch_steps"),
    "sparse_dist_pipeline": ("train", "sparse_dist_pipeline"),
    "prefetch_sched": ("train", "prefetch_sched"),
    "fused_interaction": ("train", "fused_interaction"),
    "rowwise_adagrad_kernel": ("train", "rowwise_adagrad_kernel"),
    "dense_grad_exchange": ("train", "dense_grad_exchange"),
    "workers": ("resources", "workers"),
    "threads_per_worker": ("resources", "threads_per_worker"),
    "worker_allocator": ("resources", "allocator"),
    "resources_policy": ("resources", "policy"),
    "max_restarts": ("resources", "max_restarts"),
    "job_timeout_s": ("resources", "job_timeout_s"),
    "preprocessing": ("preprocessing",),
    "corun_mapping": ("corun", "mapping"),
    "preprocess_executor": ("preprocess_executor",),
    "preprocess_plan": ("preprocess_plan",),
    "compile_backend": ("compile_backend",),
    "checkpoint_every_steps": ("checkpoint", "every_steps"),
    "checkpoint_flash": ("checkpoint", "flash"),
    "champion_margin": ("champion_margin",),
    "champion_min_auc": ("champion_min_auc",),
    "champion_min_rows": ("champion_min_rows",),
}
# Airflow's execution_timeout of each recforge_daily task, sized to what the stage does at the largest sizes we run
# (seconds); `RECFORGE_TIMEOUT_<TASK>_S` overrides one where the DAG file is parsed (the scheduler, the DAG
# processor) and where the task runs. The train task allows the training job's own limit (resources.job_timeout_s,
# whose trigger Param is checked against it) plus TRAIN_MARGIN_S for the preprocessing, logging and model files
# around the job.
TRAIN_MARGIN_S = 1800.0
STAGE_TIMEOUTS_S: dict[str, float] = {
    # the sensor's own timeout (sensor_timeout_s, at most 7 days) fails it first, naming what is missing
    "wait_for_data": 7 * 86400.0 + 3600.0,
    "generate": 3600.0, "ingest": 2 * 3600.0, "plan_resources": 3600.0, "train": JOB_TIMEOUT_S + TRAIN_MARGIN_S,
    "evaluate": 3600.0, "compile": 3600.0, "publish": 1800.0,
}
# A `str` field whose values a validator checks (not a Literal): its enum, from the set that validator uses.
# free text with suggestions (the form offers them; a schema file path is also valid)
FIELD_EXAMPLES: dict[str, list[str]] = {"dataset_schema": ["criteo_kaggle", "criteo_terabyte"]}
_JSON_TYPES: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}
_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


class ParamError(InvalidInput):
    """A Param in the run's conf is unknown, of the wrong type or out of range; the message names it."""


def timeout_env(task_id: str) -> str:
    """The environment variable that overrides `task_id`'s execution_timeout."""
    return f"RECFORGE_TIMEOUT_{task_id.upper()}_S"


def stage_timeout(task_id: str) -> timedelta:
    """The execution_timeout of a recforge_daily task: STAGE_TIMEOUTS_S, or its `timeout_env` in seconds. A task
    past it is failed by Airflow (SIGTERM: the stage closes its MLflow runs, the training job stops its workers)."""
    if task_id not in STAGE_TIMEOUTS_S:
        raise KeyError(f"no execution_timeout for task {task_id!r}; known: {sorted(STAGE_TIMEOUTS_S)}")
    name = timeout_env(task_id)
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return timedelta(seconds=STAGE_TIMEOUTS_S[task_id])
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{name}={raw!r}: the execution_timeout of task {task_id!r} must be a number of seconds > 0")
    return timedelta(seconds=seconds)


def _job_timeout_problem(cfg: dict[str, Any]) -> str | None:
    """Why the run's training-job limit does not fit inside the train task's execution_timeout (None: it does)."""
    job = (cfg.get("resources") or {}).get("job_timeout_s")
    task = stage_timeout("train").total_seconds()
    if job is None or not isinstance(job, (int, float)) or job + TRAIN_MARGIN_S <= task:
        return None
    return (f"param 'job_timeout_s': must be <= {task - TRAIN_MARGIN_S:g}, got {job!r} (the train task's "
            f"execution_timeout {task:g} s less {TRAIN_MARGIN_S:g} s for the task's own work; "
            f"{timeout_env('train')} raises it)")


def _field(path: tuple[str, ...]) -> tuple[Any, Any]:
    """The pydantic FieldInfo at `path` of PipelineConfig and its default (nested models' defaults included)."""
    model: type[BaseModel] = PipelineConfig
    default: Any = PipelineConfig()
    for key in path[:-1]:
        model = model.model_fields[key].annotation  # type: ignore[assignment]
        default = getattr(default, key)
    return model.model_fields[path[-1]], getattr(default, path[-1])


def _json_type(annotation: Any) -> tuple[str | list[str], list[Any] | None]:
    """JSON-schema type (and enum) of a field's annotation: bool/int/float/str, Literal[...] of str, X | None."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner, enum = _json_type(next(a for a in args if a is not type(None)))
        return ["null", inner] if isinstance(inner, str) else ["null", *inner], enum
    if origin is Literal and all(isinstance(a, str) for a in args):
        return "string", list(args)
    if annotation in _JSON_TYPES:
        return _JSON_TYPES[annotation], None
    raise TypeError(f"no Param type for a field of type {annotation!r}")


def param_spec(name: str) -> dict[str, Any]:
    """Airflow Param keyword arguments of `name`: default, JSON-schema type, description, enum and bounds, all read
    off the PipelineConfig field it maps to."""
    info, default = _field(PARAM_FIELDS[name])
    jtype, enum = _json_type(info.annotation)
    spec: dict[str, Any] = {"default": default, "type": jtype, "description": info.description or ""}
    if enum is not None:
        spec["enum"] = enum
    if name in FIELD_EXAMPLES:
        spec["examples"] = FIELD_EXAMPLES[name]
    for constraint in info.metadata:
        for attr, key in _BOUNDS.items():
            if getattr(constraint, attr, None) is not None:
                spec[key] = getattr(constraint, attr)
    return spec


# the deployment's landing zone: the `source_uri` Param's default where the DAG is parsed (scripts/services.sh and
# recforge.settings set <RECFORGE_HOME>/landing/day_{ds}.tsv.gz unless set; empty: synthetic days)
SOURCE_URI_ENV = "RECFORGE_SOURCE_URI"


def default_params() -> dict[str, dict[str, Any]]:
    """Every Param of the daily DAG (name -> Param keyword arguments), read off PipelineConfig; `source_uri`
    defaults to $RECFORGE_SOURCE_URI when set (checked like any value: a bad one fails the DAG's parse, naming it)."""
    params = {name: param_spec(name) for name in PARAM_FIELDS}
    uri = os.environ.get(SOURCE_URI_ENV, "").strip()
    if uri:
        try:
            PipelineConfig(source_uri=uri)
        except ValidationError as e:
            raise ValueError(f"{SOURCE_URI_ENV}={uri!r}: {_pydantic_problem(e.errors()[0])}") from None
        params["source_uri"]["default"] = uri
    return params


def _type_problem(value: Any, jtype: str | list[str]) -> str | None:
    """Why `value` is not of the Param's JSON type (the trigger form's check), None when it is."""
    ok = {"null": value is None, "boolean": isinstance(value, bool), "string": isinstance(value, str),
          "integer": isinstance(value, int) and not isinstance(value, bool)
          or isinstance(value, float) and value.is_integer(),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool)}
    wanted = [jtype] if isinstance(jtype, str) else jtype
    if any(ok[t] for t in wanted):
        return None
    names = {"null": "empty", "boolean": "a boolean", "string": "a string", "integer": "an integer",
             "number": "a number"}
    return f"must be {' or '.join(names[t] for t in wanted)}, got {value!r} ({type(value).__name__})"


def _pydantic_problem(err: Any) -> str:
    ctx = err.get("ctx") or {}
    symbols = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
               "less_than": ("<", "lt")}
    if err["type"] in symbols:
        symbol, key = symbols[err["type"]]
        return f"must be {symbol} {ctx[key]}, got {err['input']!r}"
    if err["type"] == "literal_error":
        return f"must be one of {ctx.get('expected')}, got {err['input']!r}"
    return f"{str(err['msg']).removeprefix('Value error, ')}"


def config_from_params(params: dict[str, Any]) -> dict[str, Any]:
    """Nest the flat DAG Params into a PipelineConfig dict, validated.

    Airflow merges any trigger conf key into the params without checking it: an unknown key (a typo such as
    "row_per_day"), a value of the wrong type or out of range is a ParamError naming the Param. An empty value
    (None or "") means "not set": the config's default."""
    unknown = sorted(set(params) - set(PARAM_FIELDS))
    if unknown:
        raise ParamError(f"unknown recforge_daily param(s) {unknown} in the run's conf; known: {sorted(PARAM_FIELDS)}")
    cfg: dict[str, Any] = {}
    problems = []
    for name, path in PARAM_FIELDS.items():
        value = params.get(name)
        if value is None or value == "":
            continue
        jtype = param_spec(name)["type"]
        problem = _type_problem(value, jtype)
        if problem:
            problems.append(f"param {name!r}: {problem}")
            continue
        node = cfg
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = int(value) if jtype == "integer" else value
    try:  # ranges, enums and the config's own validators; the values of the wrong type are left out above
        PipelineConfig.model_validate(cfg)
    except ValidationError as e:
        problems += [_named(err) for err in e.errors()]
    timeout = _job_timeout_problem(cfg)
    if timeout:
        problems.append(timeout)
    if problems:
        raise ParamError("; ".join(problems))
    return cfg


def _named(err: Any) -> str:
    """A pydantic error of the nested config, named by the Param whose field it is."""
    loc = tuple(str(p) for p in err["loc"])
    for name, path in PARAM_FIELDS.items():
        if loc[:len(path)] == path:
            return f"param {name!r}: {_pydantic_problem(err)}"
    return f"config {'.'.join(loc) or '(top)'}: {_pydantic_problem(err)}"


def run_day_of(context: dict[str, Any]) -> date | None:
    """The run's day: its logical date's (UTC), or run_after's for a manual run without one (Airflow 3)."""
    when = context.get("logical_date") or getattr(context["dag_run"], "run_after", None)
    if when is None:
        return None
    return (when.astimezone(UTC) if when.tzinfo else when).date()


def data_day_of(context: dict[str, Any], config: dict[str, Any]) -> int:
    """Calendar day (days since 0001-01-01) of the run's first day: the `train_days` days the run trains on end with
    the run's own day (run_day_of); 0 when the run has no day."""
    day = run_day_of(context)
    if day is None:
        return 0
    train_days = config.get("train_days", PipelineConfig.model_fields["train_days"].default)
    return max(0, day.toordinal() - int(train_days) + 1)


def run_type_of(context: dict[str, Any]) -> str:
    """How Airflow started the DAG run (DagRun.run_type: scheduled, manual, backfill, ...); "manual" if unknown."""
    run_type = getattr(context["dag_run"], "run_type", None)
    return str(getattr(run_type, "value", run_type) or "manual")


def run_stage_from_context(stage: str, context: dict[str, Any]) -> dict[str, Any]:
    """Run `stage` for the task's DAG run; its small scalar outputs are the task's XCom.

    Invalid input (INVALID_INPUT: a bad or unknown Param, a config or record that fails its schema, InvalidInput)
    and bad data (a DataError, logged first as `DATA ERROR: <one line>`) raise AirflowFailException: the task fails
    at once, a retry could not fix it. Anything else (a worker crash, OSError, a timeout, SIGTERM) propagates and
    Airflow retries while attempts remain. Either way the DAG run's
    MLflow runs end FAILED with the reason (run_stage records failures inside a stage, this those before it)."""
    run_key = context["dag_run"].run_id
    with sigterm_raises():
        try:
            config = config_from_params(dict(context["params"]))
            ctx = RunContext.create(run_key, config, data_day=data_day_of(context, config),
                                    run_type=run_type_of(context))
            from recforge.pipelines.runner import STAGE_FUNCTIONS  # lazy: the stages' modules off the DAG-parse path

            out = STAGE_FUNCTIONS[stage](ctx).model_dump(mode="json")
        except BaseException as e:
            log_data_error(e)  # `DATA ERROR: <one line>` first in the task log (once: run_stage may have logged it)
            if not is_recorded(e):
                record_failure(run_key, stage, e)
            if isinstance(e, INVALID_INPUT) or is_data_error(e):
                raise _no_retry(stage, e) from e
            if failure_kind(e) == "error":
                _record_retry(context, run_key, stage)
            raise
    # XCom carries only small scalars; the full outputs stay in the stage's outputs.json
    return {k: v for k, v in out.items() if isinstance(v, (str, int, float, bool)) or v is None}


def _no_retry(stage: str, e: BaseException) -> Exception:
    from airflow.sdk.exceptions import AirflowFailException  # lazy: Airflow only inside a task, not on the CLI path

    if is_data_error(e):  # the data stays as bad on a retry
        return AirflowFailException(f"DATA ERROR: {stage}: {' '.join(str(e).split())} (bad input data, not retried)")
    return AirflowFailException(f"{stage}: invalid input, not retried: {type(e).__name__}: {e}")


def record_failure(run_key: str, stage: str, e: BaseException) -> None:
    """A failure before the stage's own MLflow run (a bad Param, an upstream record that fails its schema): the DAG
    run's parent run FAILED with it, so the run shows why."""
    try:
        from recforge.tracking import TrackingStore  # lazy: mlflow off the DAG-parse path

        TrackingStore().fail_pipeline(EXPERIMENT, run_key_from(run_key), stage, failure_reason(e),
                                      kind=failure_kind(e))
    except Exception:  # the stage's failure is what the task reports, not MLflow's trouble recording it
        log.exception("could not record the failure of %s / %s in MLflow", run_key, stage)


def _record_retry(context: dict[str, Any], run_key: str, stage: str) -> None:
    """When Airflow will retry the task (attempts left), say so on its FAILED runs: the failure is not final yet."""
    ti = context.get("ti") or context.get("task_instance")
    try_number, max_tries = getattr(ti, "try_number", None), getattr(ti, "max_tries", None)
    if not (isinstance(try_number, int) and isinstance(max_tries, int) and try_number <= max_tries):
        return
    try:
        from recforge.tracking import TrackingStore  # lazy: mlflow off the DAG-parse path

        TrackingStore().mark_retrying(EXPERIMENT, run_key_from(run_key), stage,
                                      f"attempt {try_number} of {max_tries + 1} failed; Airflow retries the task")
    except Exception:
        log.exception("could not record the retry of %s / %s in MLflow", run_key, stage)


def close_open_runs(context: dict[str, Any]) -> list[str]:
    """The DAG's on_failure_callback (Airflow 3 runs it in the DAG processor when a DAG run fails): the run's MLflow
    runs still RUNNING end FAILED. A stage closes its own runs on any exception or SIGTERM; only a task process
    killed outright (SIGKILL, OOM, a lost worker) leaves one open. Returns the MLflow run ids it closed."""
    from recforge.tracking import TrackingStore  # lazy: mlflow off the DAG-parse path

    dag_run = context.get("dag_run")
    run_id = context.get("run_id") or getattr(dag_run, "run_id", None)
    if not run_id:
        log.error("close_open_runs: the callback context names no DAG run: %s", sorted(context))
        return []
    reason = (f"killed: the task process died without closing its run (SIGKILL, out of memory or a lost worker); "
              f"the DAG run failed ({context.get('reason') or 'a task failed'})")
    closed = TrackingStore().fail_open_runs(EXPERIMENT, run_key_from(str(run_id)), reason, kind="killed")
    log.info("close_open_runs: %d MLflow run(s) of %s closed as FAILED", len(closed), run_id)
    return closed


def params_markdown() -> str:
    """The README's options table: one row per Param, from the same specs the DAG uses."""
    rows = ["| Param | config field | values | default | what it does |", "|---|---|---|---|---|"]
    for name, path in PARAM_FIELDS.items():
        spec = param_spec(name)
        rows.append(f"| `{name}` | `{'.'.join(path)}` | {_values(spec)} | {_cell_default(spec['default'])} | "
                    f"{spec['description'].replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def _values(spec: dict[str, Any]) -> str:
    if "enum" in spec:
        return ", ".join(f"`{v}`" for v in spec["enum"])
    jtype = spec["type"]
    kinds = [jtype] if isinstance(jtype, str) else [t for t in jtype if t != "null"]
    text = " or ".join(kinds) + (" or empty" if isinstance(jtype, list) and "null" in jtype else "")
    bounds = [f"{sym} {spec[key]}" for key, sym in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                     ("maximum", "<="), ("exclusiveMaximum", "<")) if key in spec]
    return text + (f" {', '.join(bounds)}" if bounds else "")


def _cell_default(value: Any) -> str:
    if value is None:
        return "empty"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recforge.pipelines.dag_tasks")
    parser.add_argument("--markdown", action="store_true", help="print the README's Params table")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.error("nothing to do: pass --markdown")
    print(params_markdown(), end="")


if __name__ == "__main__":
    main()
