"""What stages 2 and 3 observe of a running job: one report of its profiler (the job master)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from recforge.elastic.optimizer.plans import PodPlan


@dataclass
class Observation:
    """One report from the job's profiler (the job master)."""

    time_s: float
    plan: PodPlan
    samples_per_s: float | None = None
    step: int = 0                                 # batches done by the whole job (samples / batch size)
    worker_step_s: Sequence[float] = ()           # recent mean step time per worker
    worker_cpu_util: Sequence[float] = ()         # per worker: cores used / cores allocated (0..1)
    worker_memory: Sequence[float] = ()           # RSS bytes per worker
    server_memory: Sequence[float] = ()           # RSS bytes per server
    server_cpu_util: Sequence[Sequence[float]] = ()  # per server: recent utilization samples (0..1)
    shard_load: Sequence[float] = ()              # per server / embedding shard: lookups or bytes
    pending_s: float = 0.0
    oom_workers: Sequence[int] = ()               # workers that were OOM-killed since the last report
    oom_servers: Sequence[int] = ()
    total_steps: float | None = None
