"""RAP's planning: which fused kernel runs in which stage (schedule, scheduler), and the predicted iteration time."""
from __future__ import annotations

from recforge.exports import lazy_exports

# Names resolve on first use: RAP's modules load torch, the package itself stays cheap.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.rap.planning.schedule": (
        "Assignment", "CorunSchedule", "ScheduleError", "executable_parts", "whole_kernel_schedule",
    ),
    "recforge.rap.planning.scheduler": ("mapped_rank_schedules", "rank_schedule"),
    "recforge.rap.planning.simulator": ("METHODS", "KernelCost", "RankStages", "SimResult", "SimSetup", "simulate"),
    "recforge.rap.planning.job_schedule": (
        "measured_kernel_cost", "plan_schedule", "simulated_iteration_ms", "stored_profile",
    ),
    "recforge.rap.planning.gantt": ("gantt_tasks", "log_schedule", "measured_gantt", "save_png"),
    "recforge.rap.planning.choice": ("CORUN_MARGIN", "ModeChoice", "ModePredictions", "choose_mode"),
})
