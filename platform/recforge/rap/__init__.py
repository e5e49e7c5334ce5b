"""RAP (ASPLOS '24): fused preprocessing kernels co-run in the spare capacity of the training step's stages on the
same workers. Subpackages by role: profiling (stage times, spare capacity, kernel costs), planning (schedule,
scheduler, simulator), mapping (where tables and their preprocessing live), runtime (the co-run inside a worker).
The design and the paper's ideas: docs/rap.md.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {  # defining module -> its public names
    "recforge.rap.profiling.stages": ("STAGES", "StageTracker"),
    "recforge.rap.profiling.profiler": ("ProfileKey", "ProfileMismatch", "StageProfile", "StageProfiler"),
    "recforge.rap.profiling.profile_job": ("ensure_profile", "profile_job"),
    "recforge.rap.profiling.kernel_timer": ("group_timer",),
    "recforge.rap.planning.schedule": ("Assignment", "CorunSchedule", "ScheduleError", "whole_kernel_schedule"),
    "recforge.rap.planning.scheduler": ("mapped_rank_schedules", "schedule"),
    "recforge.rap.planning.simulator": ("SimSetup", "simulate"),
    "recforge.rap.planning.job_schedule": ("plan_schedule", "simulated_iteration_ms"),
    "recforge.rap.planning.gantt": ("log_schedule",),
    "recforge.rap.mapping.milp": ("MappingCosts", "MappingError", "Placement", "TableLoad", "solve"),
    "recforge.rap.mapping.job_mapping": ("plan_mapping", "planner_placements"),
    "recforge.rap.mapping.worker_mapping": (
        "MAPPING_FILE", "MappingFileError", "WorkerMapping", "load_mapping", "mapped_jobs", "write_mapping",
    ),
    "recforge.rap.mapping.mapped_input": ("MappedInput",),
    "recforge.rap.runtime.corun_runtime": ("CorunConfigError", "CorunRuntime"),
    "recforge.rap.runtime.session": ("CorunSession",),
    "recforge.rap.runtime.offline": ("OfflineTaskBatches", "preprocess_manifest"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining module on first use: RAP's modules load torch, the package itself stays cheap."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
