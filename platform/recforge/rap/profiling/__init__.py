"""RAP's measurements: a training step's stage times and spare capacity, and what fused kernels cost."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {  # defining module -> its public names
    "recforge.rap.profiling.stages": ("STAGES", "StageOrderError", "StageTracker", "StepTiming"),
    "recforge.rap.profiling.profiler": (
        "ProfileKey", "ProfileMismatch", "ProxyKernel", "StageProfile", "StageProfiler", "log_profile",
    ),
    "recforge.rap.profiling.profile_job": ("ensure_profile",),
    "recforge.rap.profiling.profile_ranks": ("profile_in_processes",),
    "recforge.rap.profiling.kernel_timer": ("GroupTimer", "group_timer"),
    "recforge.rap.profiling.cost_model": ("CostModel", "Measurement", "fit", "predict_group"),
    "recforge.rap.profiling.cost_probe": ("measure",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining module on first use: RAP's modules load torch, the package itself stays cheap."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
