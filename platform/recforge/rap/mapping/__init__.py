"""RAP's mapping: where each table and its preprocessing live (a MILP), and the mapped co-run's input path."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {  # defining module -> its public names
    "recforge.rap.mapping.milp": (
        "MappingCosts", "MappingError", "MappingResult", "Placement", "TableLoad", "candidate_placements", "evaluate",
        "from_torchrec", "rank_plan", "solve", "split_rank_plan",
    ),
    "recforge.rap.mapping.job_mapping": (
        "COMPILE_METHOD", "placements_from_json", "placements_to_json", "plan_mapping", "planner_placements",
    ),
    "recforge.rap.mapping.worker_mapping": (
        "MAPPING_FILE", "MappingFileError", "WorkerMapping", "load_mapping", "mapped_jobs", "placements_for_world",
        "write_mapping",
    ),
    "recforge.rap.mapping.mapped_input": ("MappedInput", "MappedInputError"),
    "recforge.rap.mapping.mapped_batches": ("MappedCorunBatches", "MappedTaskBatches"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining module on first use: RAP's modules load torch, the package itself stays cheap."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
