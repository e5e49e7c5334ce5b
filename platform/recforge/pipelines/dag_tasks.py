"""Glue between Airflow's task context and the stage functions (keeps DAG files to wiring only)."""
from __future__ import annotations

from typing import Any, get_args

from recforge.config import DATASET_PRESETS, PipelineConfig
from recforge.pipelines.context import RunContext

# Param name -> PipelineConfig field path. Airflow 3 TaskFlow reserves `run_id`, so none is used here.
PARAM_FIELDS = {
    "dataset_preset": ("dataset_preset",),
    "rows_per_day": ("rows_per_day",),
    "train_days": ("train_days",),
    "workers": ("resources", "workers"),
    "epochs": ("train", "epochs"),
    "batch_size": ("train", "batch_size"),
    "seed": ("seed",),
    "table_cap": ("table_cap",),
    "model_arch": ("model", "arch"),
    "source_dir": ("source_dir",),
    "preprocessing": ("preprocessing",),
    "corun_mapping": ("corun", "mapping"),
}


def config_from_params(params: dict[str, Any]) -> dict[str, Any]:
    """Nest the flat DAG Params into a PipelineConfig dict (validated by the stage).

    Airflow merges any trigger conf key into the params without checking it: an unknown key (a typo such as
    "row_per_day") is an error naming it, not a silently ignored setting."""
    unknown = sorted(set(params) - set(PARAM_FIELDS))
    if unknown:
        raise ValueError(f"unknown recforge_daily param(s) {unknown} in the run's conf; known: {sorted(PARAM_FIELDS)}")
    cfg: dict[str, Any] = {}
    for name, path in PARAM_FIELDS.items():
        if name not in params or params[name] in (None, ""):
            continue
        node = cfg
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = params[name]
    return cfg


def default_params() -> dict[str, dict[str, Any]]:
    """Defaults and JSON-schema types for the DAG's Params, read off PipelineConfig."""
    cfg = PipelineConfig()
    return {
        "dataset_preset": {"default": cfg.dataset_preset, "type": "string", "enum": sorted(DATASET_PRESETS),
                           "description": "dataset schema preset"},
        "rows_per_day": {"default": cfg.rows_per_day, "type": "integer", "minimum": 100,
                         "description": "synthetic rows per day"},
        "train_days": {"default": cfg.train_days, "type": "integer", "minimum": 1},
        "workers": {"default": cfg.resources.workers, "type": "integer", "minimum": 1, "maximum": 8,
                    "description": "training worker processes"},
        "epochs": {"default": cfg.train.epochs, "type": "integer", "minimum": 1},
        "batch_size": {"default": cfg.train.batch_size, "type": "integer", "minimum": 1,
                       "description": "per-worker batch size"},
        "seed": {"default": cfg.seed, "type": "integer"},
        "table_cap": {"default": cfg.table_cap, "type": "integer", "minimum": 1,
                      "description": "rows per embedding table"},
        "model_arch": {"default": cfg.model.arch, "type": "string", "enum": ["dlrm", "dlrm_dcn"]},
        # "null" in the type makes the field optional in Airflow's trigger form (an empty required field blocks it)
        "source_dir": {"default": None, "type": ["null", "string"],
                       "description": "directory of raw day_*.tsv files; empty generates synthetic data"},
        "preprocessing": {"default": cfg.preprocessing, "type": "string",
                          "enum": list(get_args(PipelineConfig.model_fields["preprocessing"].annotation)),
                          "description": "inline: before each step; corun: RAP co-running in the workers; "
                                         "offline: the training data preprocessed first"},
        "corun_mapping": {"default": cfg.corun.mapping, "type": "boolean",
                          "description": "with corun and 2+ workers: RAP's mapping (each table's ids preprocessed "
                                         "on its owner, no input all-to-all)"},
    }


def data_day_of(context: dict[str, Any], config: dict[str, Any]) -> int:
    """Calendar day (days since 0001-01-01) of the run's first synthetic day: its data interval's day minus the
    training days, so the held-out day is the run's own day. Manual runs without a logical date use run_after."""
    when = context.get("logical_date") or getattr(context["dag_run"], "run_after", None)
    if when is None:
        return 0
    train_days = config.get("train_days", PipelineConfig.model_fields["train_days"].default)
    return max(0, when.date().toordinal() - int(train_days))


def run_stage_from_context(stage: str, context: dict[str, Any]) -> dict[str, Any]:
    from recforge.pipelines.runner import STAGE_FUNCTIONS  # lazy: the stages' modules off the DAG-parse path

    config = config_from_params(dict(context["params"]))
    ctx = RunContext.create(context["dag_run"].run_id, config, data_day=data_day_of(context, config))
    out = STAGE_FUNCTIONS[stage](ctx).model_dump(mode="json")
    # XCom carries only small scalars; the full outputs stay in the stage's outputs.json
    return {k: v for k, v in out.items() if isinstance(v, (str, int, float, bool)) or v is None}
