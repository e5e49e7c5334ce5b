"""What a worker group does at each logging-window boundary (every rank, in lockstep).

1. injected faults (tests only, recforge.train.recovery.faults);
2. rank 0 asks the job master whether the group must stop (a rescale) and tells the other ranks;
3. a checkpoint when one is due, or before stopping;
4. stopping raises `GroupStop`: the worker exits cleanly and the supervisor relaunches the job.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from recforge.train.loop.step_loop import EpochStats, LoopState
from recforge.train.recovery import faults as fault_injection
from recforge.train.recovery.checkpointer import Checkpointer


class GroupStop(Exception):
    """The master asked the group to checkpoint and stop (e.g. to relaunch at another world size)."""


class WindowHook:
    def __init__(self, checkpointer: Checkpointer, client: Any, progress: Callable[[], dict[str, int]], *,
                 rank: int, generation: int, micro_batch: int, faults: list[dict[str, Any]] | None = None) -> None:
        self.checkpointer, self.client, self.progress = checkpointer, client, progress
        self.rank, self.generation, self.micro_batch = rank, generation, micro_batch
        self.faults = faults if faults is not None else fault_injection.load()
        self.stop_reason: str | None = None

    def __call__(self, state: LoopState, stats: EpochStats) -> None:
        if self.faults:
            fault_injection.maybe_inject(self.faults, step=state.step, rank=self.rank, generation=self.generation,
                                         micro_batch=self.micro_batch)
        stop = torch.zeros(1, dtype=torch.int64)
        reason = ""
        if self.rank == 0:
            answer = self.client.command()
            if answer["command"] == "stop":
                stop[0], reason = 1, answer["reason"]
        dist.broadcast(stop, src=0)
        if stop.item() or self.checkpointer.due(state.step):
            self.checkpointer.save(state, stats, self.progress())
        if stop.item():
            self.stop_reason = reason or "stop requested by the job master"
            raise GroupStop(self.stop_reason)
