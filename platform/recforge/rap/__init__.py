"""RAP (ASPLOS '24): fused preprocessing kernels co-run in the spare capacity of the training step's stages on the
same workers. Subpackages by role: profiling (stage times, spare capacity, kernel costs), planning (schedule,
scheduler, simulator), mapping (where tables and their preprocessing live), runtime (the co-run inside a worker).
The design and the paper's ideas: docs/rap.md.
"""
from __future__ import annotations

from recforge.exports import lazy_exports

# Names resolve on first use: RAP's modules load torch, the package itself stays cheap.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
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
})
