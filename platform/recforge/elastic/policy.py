"""Resource decisions (the `Policy` seam): how many workers, how many threads each.

`StaticPolicy` returns the user's ResourceConfig as is; the DLRover-RM optimizer (recforge.elastic.optimizer)
implements the same Protocol (docs/dlrover_rm.md).
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from recforge.config import ResourceConfig


class OversubscriptionWarning(UserWarning):
    """More worker threads than CPU cores were requested."""


@dataclass(frozen=True)
class ResourcePlan:
    """What a backend launches: `workers` worker processes (pods), `threads_per_worker` threads each.
    DLRover-RM plans more (`optimizer.PodPlan`: CPU and memory per pod) and hands the seam this part."""

    workers: int
    threads_per_worker: int

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"ResourcePlan.workers must be >= 1, got {self.workers}")
        if self.threads_per_worker < 1:
            raise ValueError(f"ResourcePlan.threads_per_worker must be >= 1, got {self.threads_per_worker}")


@dataclass(frozen=True)
class JobInfo:
    """What a policy may look at when planning a job."""

    shard_rows: Sequence[int]
    epochs: int
    rows_per_task: int
    resources: ResourceConfig
    name: str = "train"
    extra: dict = field(default_factory=dict)

    @property
    def total_rows(self) -> int:
        return sum(self.shard_rows) * self.epochs


@runtime_checkable
class Policy(Protocol):
    def plan(self, job: JobInfo) -> ResourcePlan: ...


class StaticPolicy:
    """The user's configuration, checked against the machine: oversubscription warns, never fails."""

    def __init__(self, resources: ResourceConfig, cpu_count: int | None = None) -> None:
        self.resources = resources
        self.cpu_count = cpu_count if cpu_count is not None else (os.cpu_count() or 1)

    def plan(self, job: JobInfo | None = None) -> ResourcePlan:
        r = self.resources
        plan = ResourcePlan(workers=r.workers, threads_per_worker=r.threads_per_worker)
        want = plan.workers * plan.threads_per_worker
        if want > self.cpu_count:
            warnings.warn(
                f"resources: workers ({plan.workers}) x threads_per_worker ({plan.threads_per_worker}) = {want} "
                f"threads exceeds the {self.cpu_count} CPU cores; training will oversubscribe the CPU",
                OversubscriptionWarning,
                stacklevel=2,
            )
        return plan
