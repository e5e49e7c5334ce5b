"""The job master: task queue with dynamic data sharding (HTTP service), supervisor of the worker group, failover,
DLRover-RM scaler."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recforge.elastic.master.dlrover_scaler import DLRoverScaler, scaler_from_stage1
    from recforge.elastic.master.failover import FailoverPolicy, Failure, read_records, record_exception
    from recforge.elastic.master.service import JobMaster, MasterRejection, ScaleRejectedError, shard_rows_from_manifest
    from recforge.elastic.master.supervisor import Rescale, Scaler, Supervisor, SupervisorResult
    from recforge.elastic.master.tasks import Action, Grant, Outcome, Task, TaskQueue, TaskState

# Names resolve on first use: workers import tasks and failover without FastAPI or the supervisor.
_EXPORTS = {
    "Action": "recforge.elastic.master.tasks",
    "Grant": "recforge.elastic.master.tasks",
    "Outcome": "recforge.elastic.master.tasks",
    "Task": "recforge.elastic.master.tasks",
    "TaskQueue": "recforge.elastic.master.tasks",
    "TaskState": "recforge.elastic.master.tasks",
    "JobMaster": "recforge.elastic.master.service",
    "MasterRejection": "recforge.elastic.master.service",
    "ScaleRejectedError": "recforge.elastic.master.service",
    "shard_rows_from_manifest": "recforge.elastic.master.service",
    "Rescale": "recforge.elastic.master.supervisor",
    "Scaler": "recforge.elastic.master.supervisor",
    "Supervisor": "recforge.elastic.master.supervisor",
    "SupervisorResult": "recforge.elastic.master.supervisor",
    "Failure": "recforge.elastic.master.failover",
    "FailoverPolicy": "recforge.elastic.master.failover",
    "read_records": "recforge.elastic.master.failover",
    "record_exception": "recforge.elastic.master.failover",
    "DLRoverScaler": "recforge.elastic.master.dlrover_scaler",
    "scaler_from_stage1": "recforge.elastic.master.dlrover_scaler",
}

__all__ = [
    "Action", "DLRoverScaler", "FailoverPolicy", "Failure", "Grant", "JobMaster", "MasterRejection", "Outcome",
    "Rescale", "ScaleRejectedError", "Scaler", "Supervisor", "SupervisorResult", "Task", "TaskQueue", "TaskState",
    "read_records", "record_exception", "scaler_from_stage1", "shard_rows_from_manifest",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
