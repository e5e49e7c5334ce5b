"""RAP's planning: which fused kernel runs in which stage (schedule, scheduler), and the predicted iteration time."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {  # defining module -> its public names
    "recforge.rap.planning.schedule": (
        "Assignment", "CorunSchedule", "ScheduleError", "executable_parts", "whole_kernel_schedule",
    ),
    "recforge.rap.planning.scheduler": ("mapped_rank_schedules", "rank_schedule"),
    "recforge.rap.planning.simulator": ("METHODS", "KernelCost", "RankStages", "SimResult", "SimSetup", "simulate"),
    "recforge.rap.planning.job_schedule": (
        "measured_kernel_cost", "plan_schedule", "simulated_iteration_ms", "stored_profile",
    ),
    "recforge.rap.planning.gantt": ("log_schedule", "save_png"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining module on first use: RAP's modules load torch, the package itself stays cheap."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
