"""The optimizer's vocabulary: the plan it decides (`PodPlan`), the limits a plan must fit (`JobLimits`),
what it knows of a job before it runs (`JobDescription`), and its settings (`OptimizerConfig`)."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import psutil

from recforge.elastic.optimizer.models.memory_model import GiB
from recforge.elastic.optimizer.models.throughput_model import Allocation
from recforge.elastic.policy import ResourcePlan


class ResourceLimitError(ValueError):
    """The job's resource limits cannot hold even one minimal worker."""


@dataclass(frozen=True)
class PodPlan:
    """What DLRover-RM plans for a job: worker (and parameter-server) pods, each pod's CPU cores and
    memory, and the batch size. `to_resource_plan()` is the part the `Policy` seam launches."""

    workers: int
    cpu_per_worker: float
    memory_per_worker: float  # bytes
    batch_size: int = 512
    servers: int = 0
    cpu_per_server: float = 0.0
    memory_per_server: float = 0.0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.cpu_per_worker <= 0 or self.memory_per_worker <= 0:
            raise ValueError(f"PodPlan needs workers >= 1, cpu and memory > 0: {self}")

    @property
    def cpu_total(self) -> float:
        return self.workers * self.cpu_per_worker + self.servers * self.cpu_per_server

    @property
    def memory_total(self) -> float:
        return self.workers * self.memory_per_worker + self.servers * self.memory_per_server

    def allocation(self, host_cores: float | None = None) -> Allocation:
        return Allocation(self.workers, self.cpu_per_worker, self.batch_size, self.servers,
                          self.cpu_per_server, host_cores)

    def to_resource_plan(self) -> ResourcePlan:
        return ResourcePlan(workers=self.workers, threads_per_worker=max(1, int(round(self.cpu_per_worker))))

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PodPlan:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class JobLimits:
    """What one job may use in total (an ElasticJob's resourceLimits) and per pod."""

    cpu: float
    memory: float
    max_workers: int = 60
    max_servers: int = 15
    min_cpu_per_worker: float = 1.0
    max_cpu_per_worker: float = 32.0
    max_cpu_per_server: float = 32.0
    min_memory_per_pod: float = 1 * GiB
    max_memory_per_pod: float = 64 * GiB

    def check(self) -> None:
        if self.cpu < self.min_cpu_per_worker:
            raise ResourceLimitError(
                f"limits.cpu={self.cpu} is below one worker's minimum of {self.min_cpu_per_worker} core(s)")
        if self.memory < self.min_memory_per_pod:
            raise ResourceLimitError(
                f"limits.memory={self.memory / GiB:.2f} GiB is below one worker's minimum of "
                f"{self.min_memory_per_pod / GiB:.2f} GiB")
        if self.max_workers < 1:
            raise ResourceLimitError(f"limits.max_workers={self.max_workers}: a job needs at least one worker")

    def fits(self, plan: PodPlan) -> bool:
        return (plan.cpu_total <= self.cpu + 1e-9 and plan.memory_total <= self.memory + 1e-6
                and plan.workers <= self.max_workers and plan.servers <= self.max_servers
                and self.min_cpu_per_worker <= plan.cpu_per_worker <= self.max_cpu_per_worker
                and plan.cpu_per_server <= self.max_cpu_per_server
                and plan.memory_per_worker <= self.max_memory_per_pod)

    @classmethod
    def of_this_machine(cls) -> JobLimits:
        return cls(cpu=float(os.cpu_count() or 1), memory=float(psutil.virtual_memory().total) * 0.8,
                   max_cpu_per_worker=float(os.cpu_count() or 1))


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer's thresholds and pacing; the defaults are DLRover-RM's."""

    min_gain_ratio: float = 0.2        # DLRover: stop scaling up below this marginal speed ratio
    shrink_ratio: float = 0.05         # give a unit back when removing it loses less than this
    max_units_per_step: int = 4        # DLRover: at most +4 workers a step
    interval_s: float = 300.0          # DLRover: plans applied at most every 300 s
    server_interval_s: float = 3600.0  # DLRover: PS changes at least an hour apart
    profile_samples: int = 3           # samples at a plan before stage 2 acts on it
    gib_per_core: float = 4.0          # memory counted in cores when comparing costs
    straggler_factor: float = 2.0
    hot_cpu_util: float = 0.9
    hot_samples: int = 3
    hot_shard_factor: float = 2.0
    memory_margin: float = 1.2
    oom_step_bytes: float = 8 * GiB
    memory_cap_bytes: float = 64 * GiB
    pending_timeout_s: float = 900.0
    default_worker_memory: float = 4 * GiB
    rightsize: bool = True             # DLRover: pods shrink to what they use (CPU x1.25, memory x1.5 / x1.2)
    low_util: float = 0.7              # right-size a pod group whose peak CPU utilization is below this
    cpu_headroom: float = 1.25
    worker_memory_margin: float = 1.5  # DLRover's worker memory margin (servers use memory_margin)
    max_pending_relaunches: int = 2
    relaunch_s: float = 0.0            # ours: the pause a plan change costs a synchronous job (checkpoint, stop,
                                       # relaunch); > 0: stage 2 scales only when the predicted time saved on
                                       # the samples left exceeds it (0: DLRover's rule alone)


@dataclass
class JobDescription:
    """What the optimizer knows about a job before it runs."""

    dataset: str
    model_family: str
    requested: PodPlan
    total_samples: float = 0.0
    table_bytes: Sequence[float] = ()
    parameter_server: bool = False
    host_cores: float | None = None  # all workers share one host of this many cores (local backend)


def optimizer_config(settings: Any = None) -> OptimizerConfig:
    """OptimizerConfig from a pipeline's resources.dlrover (recforge.config.DLRoverConfig); None: defaults."""
    if settings is None:
        return OptimizerConfig()
    return replace(OptimizerConfig(), profile_samples=int(settings.profile_samples),
                   interval_s=float(settings.change_interval_s), min_gain_ratio=float(settings.min_gain_ratio),
                   pending_timeout_s=float(settings.pending_timeout_s))
