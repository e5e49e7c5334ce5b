"""DLRover-RM style elastic training: the job master and its runtime, the worker-side agent, launch backends,
the resource optimizer."""
from __future__ import annotations

from typing import TYPE_CHECKING

from recforge.exports import lazy_exports

if TYPE_CHECKING:
    from recforge.elastic.backends.base import Backend as Backend
    from recforge.elastic.backends.base import JobFailedError as JobFailedError
    from recforge.elastic.job import JobResult as JobResult
    from recforge.elastic.job import run_training_job as run_training_job
    from recforge.elastic.optimizer.policy import DLRoverPolicy as DLRoverPolicy
    from recforge.elastic.policy import JobInfo as JobInfo
    from recforge.elastic.policy import OversubscriptionWarning as OversubscriptionWarning
    from recforge.elastic.policy import Policy as Policy
    from recforge.elastic.policy import ResourcePlan as ResourcePlan
    from recforge.elastic.policy import StaticPolicy as StaticPolicy

# Names resolve on first use: a worker importing the agent must not load the master, FastAPI or scipy.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.elastic.policy": ("JobInfo", "OversubscriptionWarning", "Policy", "ResourcePlan", "StaticPolicy"),
    "recforge.elastic.job": ("JobResult", "run_training_job"),
    "recforge.elastic.backends.base": ("Backend", "JobFailedError"),
    "recforge.elastic.optimizer.policy": ("DLRoverPolicy",),
})
