"""Preset preprocessing plans (RAP's plans 0-3 as YAML data files beside this module) and the datasets they read.

`load_plan("plan2")` loads a preset, `load_plan("path/to/plan.yaml")` a file, `load_plan("schema", dataset,
table_cap)` builds recforge.preprocess.planning.plan.schema_plan (the pipeline's default: derived from the dataset's
column roles) and `load_plan("criteo", dataset, table_cap)` criteo_plan (RAP's plan 0 over the dataset).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from recforge.config import (
    HASH_HEADROOM,
    DatasetConfig,
    criteo_kaggle_dataset,
    criteo_terabyte_dataset,
    rap_plan2_dataset,
    rap_plan3_dataset,
)
from recforge.preprocess.planning.plan import Plan, criteo_plan, schema_plan

PRESET_DIR = Path(__file__).parent
PRESET_PLANS = ("plan0", "plan1", "plan2", "plan3")
BUILT_PLANS = ("schema", "criteo")  # built from the dataset: schema_plan (the default), criteo_plan (RAP plan 0)
PRESET_DATASETS: dict[str, Callable[[], DatasetConfig]] = {
    "plan0": criteo_kaggle_dataset,
    "plan1": criteo_terabyte_dataset,
    "plan2": rap_plan2_dataset,
    "plan3": rap_plan3_dataset,
}


def preset_path(name: str) -> Path:
    if name not in PRESET_PLANS:
        raise ValueError(f"unknown plan preset {name!r}; presets: {list(PRESET_PLANS)} "
                         f"(or {list(BUILT_PLANS)}, or a file path)")
    return PRESET_DIR / f"{name}.yaml"


def preset_dataset(name: str) -> DatasetConfig:
    """The dataset schema a preset plan reads."""
    if name not in PRESET_DATASETS:
        raise ValueError(f"unknown plan preset {name!r}; presets: {list(PRESET_PLANS)}")
    return PRESET_DATASETS[name]()


def load_plan(name_or_path: str | Path, dataset: DatasetConfig | None = None, table_cap: int | None = None,
              hash_headroom: int = HASH_HEADROOM) -> Plan:
    """A plan built from the dataset ('schema', 'criteo'), a preset ('plan0'..'plan3') or a plan file
    (.json/.yaml/.yml); with `dataset` the plan is validated against it (PlanError names the feature and the op),
    with `table_cap` its tables are capped. `hash_headroom` sizes the schema plan's tables (RAP's plans keep
    min(cardinality, cap))."""
    key = str(name_or_path)
    if key in BUILT_PLANS:
        if dataset is None:
            raise ValueError(f"load_plan({key!r}) needs the dataset: the plan has one chain per dataset column")
        cap = table_cap if table_cap is not None else 2**62
        return schema_plan(dataset, cap, hash_headroom) if key == "schema" else criteo_plan(dataset, cap)
    if key in PRESET_PLANS:
        plan = Plan.load(preset_path(key))
    else:
        path = Path(name_or_path)
        if path.suffix not in (".json", ".yaml", ".yml"):
            raise ValueError(
                f"plan {key!r} is neither a preset {[*BUILT_PLANS, *PRESET_PLANS]} nor a .json/.yaml/.yml file"
            )
        plan = Plan.load(path)
    if table_cap is not None:
        plan = plan.with_table_cap(table_cap)
    if dataset is not None:
        plan.validate_for(dataset)
    return plan
