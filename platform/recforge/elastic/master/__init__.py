"""The job master: task queue with dynamic data sharding (HTTP service), supervisor of the worker group, failover,
DLRover-RM scaler."""
from __future__ import annotations

from typing import TYPE_CHECKING

from recforge.exports import lazy_exports

if TYPE_CHECKING:
    from recforge.elastic.master.dlrover_scaler import DLRoverScaler as DLRoverScaler
    from recforge.elastic.master.dlrover_scaler import scaler_from_stage1 as scaler_from_stage1
    from recforge.elastic.master.failover import FailoverPolicy as FailoverPolicy
    from recforge.elastic.master.failover import Failure as Failure
    from recforge.elastic.master.failover import read_records as read_records
    from recforge.elastic.master.failover import record_exception as record_exception
    from recforge.elastic.master.service import JobMaster as JobMaster
    from recforge.elastic.master.service import MasterRejection as MasterRejection
    from recforge.elastic.master.service import ScaleRejectedError as ScaleRejectedError
    from recforge.elastic.master.service import shard_rows_from_manifest as shard_rows_from_manifest
    from recforge.elastic.master.supervisor import Rescale as Rescale
    from recforge.elastic.master.supervisor import Scaler as Scaler
    from recforge.elastic.master.supervisor import Supervisor as Supervisor
    from recforge.elastic.master.supervisor import SupervisorResult as SupervisorResult
    from recforge.elastic.master.tasks import Action as Action
    from recforge.elastic.master.tasks import Grant as Grant
    from recforge.elastic.master.tasks import Outcome as Outcome
    from recforge.elastic.master.tasks import Task as Task
    from recforge.elastic.master.tasks import TaskQueue as TaskQueue
    from recforge.elastic.master.tasks import TaskState as TaskState

# Names resolve on first use: workers import tasks and failover without FastAPI or the supervisor.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.elastic.master.tasks": ("Action", "Grant", "Outcome", "Task", "TaskQueue", "TaskState"),
    "recforge.elastic.master.service": (
        "JobMaster", "MasterRejection", "ScaleRejectedError", "shard_rows_from_manifest",
    ),
    "recforge.elastic.master.supervisor": ("Rescale", "Scaler", "Supervisor", "SupervisorResult"),
    "recforge.elastic.master.failover": ("FailoverPolicy", "Failure", "read_records", "record_exception"),
    "recforge.elastic.master.dlrover_scaler": ("DLRoverScaler", "scaler_from_stage1"),
})
