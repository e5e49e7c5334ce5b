"""RAP's measurements: a training step's stage times and spare capacity, and what fused kernels cost."""
from __future__ import annotations

from recforge.exports import lazy_exports

# Names resolve on first use: RAP's modules load torch, the package itself stays cheap.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.rap.profiling.stages": ("STAGES", "StageOrderError", "StageTracker", "StepTiming"),
    "recforge.rap.profiling.profiler": (
        "ProfileKey", "ProfileMismatch", "ProxyKernel", "StageProfile", "StageProfiler", "log_profile",
    ),
    "recforge.rap.profiling.profile_job": ("ensure_profile",),
    "recforge.rap.profiling.profile_ranks": ("profile_in_processes",),
    "recforge.rap.profiling.kernel_timer": ("GroupTimer", "group_timer"),
    "recforge.rap.profiling.cost_model": ("CostModel", "Measurement", "fit", "predict_group"),
    "recforge.rap.profiling.cost_probe": ("measure",),
})
