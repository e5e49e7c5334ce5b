"""Wall time of the fused executor's kernels at a job's batch rows: the preprocessing cost RAP plans with."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from recforge.config import DatasetConfig
from recforge.preprocess.planning.compiler import FusedGroup
from recforge.preprocess.synth import random_raw_batch

GroupTimer = Callable[[FusedGroup], float]  # ms of a fused group, or of a part of one


def group_timer(executor, dataset: DatasetConfig, rows: int, repeats: int = 5, seed: int = 0) -> GroupTimer:
    """ms of a fused group or part (FusedGroup) of `executor`'s plan over `rows` synthetic rows (median of
    `repeats`; its inputs come from one full run of the plan). Each part (by its nodes) is timed once and its time
    kept: the scaling, the scheduler, the simulator and the schedule's predictions all ask for the same groups."""
    raw = random_raw_batch(dataset, rows, seed=seed)
    vals: dict = {}
    for gi, g in enumerate(executor.compiled.groups):
        executor.run_group(gi, g, raw, vals)
    keys: dict[tuple[int, ...], int] = {}
    timed: dict[tuple[int, ...], float] = {}

    def ms(group: FusedGroup) -> float:
        if group.nodes in timed:
            return timed[group.nodes]
        key = keys.setdefault(group.nodes, len(executor.compiled.groups) + len(keys))  # a cache slot per part
        executor.run_group(key, group, raw, vals)  # warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            executor.run_group(key, group, raw, vals)
            times.append((time.perf_counter() - t0) * 1e3)
        timed[group.nodes] = statistics.median(times)
        return timed[group.nodes]

    return ms


def batch_ms(executor, dataset: DatasetConfig, rows: int, repeats: int = 5, seed: int = 0) -> float:
    """ms of `executor` over one batch of `rows` synthetic rows, whole (median of `repeats` after a warm call):
    what inline preprocessing adds to a training step."""
    if rows < 1 or repeats < 1:
        raise ValueError(f"batch_ms: rows and repeats must be >= 1, got rows={rows}, repeats={repeats}")
    raw = random_raw_batch(dataset, rows, seed=seed)
    for _ in range(2):  # warm: kernel caches, first-call setup, the fused executor's trace of this batch shape
        executor(raw)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        executor(raw)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
