"""DLRover-RM style elastic training: the job master and its runtime, the worker-side agent, launch backends,
the resource optimizer."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recforge.elastic.backends.base import Backend, JobFailedError
    from recforge.elastic.job import JobResult, run_training_job
    from recforge.elastic.optimizer.policy import DLRoverPolicy
    from recforge.elastic.policy import JobInfo, OversubscriptionWarning, Policy, ResourcePlan, StaticPolicy

# Names resolve on first use: a worker importing the agent must not load the master, FastAPI or scipy.
_EXPORTS = {
    "JobInfo": "recforge.elastic.policy",
    "OversubscriptionWarning": "recforge.elastic.policy",
    "Policy": "recforge.elastic.policy",
    "ResourcePlan": "recforge.elastic.policy",
    "StaticPolicy": "recforge.elastic.policy",
    "JobResult": "recforge.elastic.job",
    "run_training_job": "recforge.elastic.job",
    "Backend": "recforge.elastic.backends.base",
    "JobFailedError": "recforge.elastic.backends.base",
    "DLRoverPolicy": "recforge.elastic.optimizer.policy",
}

__all__ = [
    "Backend", "DLRoverPolicy", "JobFailedError", "JobInfo", "JobResult", "OversubscriptionWarning", "Policy",
    "ResourcePlan", "StaticPolicy", "run_training_job",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
