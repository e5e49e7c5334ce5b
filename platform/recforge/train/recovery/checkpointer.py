"""The worker's step checkpoints: when to take one, and what goes into it.

At a logging-window boundary (every rank is there, every trained task is reported done), when
`checkpoint_every_steps` have passed or the group must stop: the ranks gather what they consumed of
the task each holds, rank 0 asks the job master for the matching data state
(`MasterClient.snapshot`), and the model + optimizer are saved with it, into shared memory (flash,
when an agent persists it) or to disk. The training stall (wall time of this collective) is recorded.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from recforge.train.loop.step_loop import EpochStats, LoopState
from recforge.train.recovery.flash import FlashSnapshotter, private_flash_root
from recforge.train.recovery.resume import loop_to_dict, save_disk

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(
        self, model: Any, optimizer: Any, client: Any, *, rank: int, world_size: int, generation: int,
        every_steps: int, disk_root: Path, memory_root: Path | None, keep: int, ledger: Any = None,
        extra_meta: Callable[[], dict[str, Any]] | None = None, last_step: int = 0,
    ) -> None:
        """`memory_root` set: flash checkpoints there (an agent persists them); None: disk saves. A memory root another
        user could write is refused on every rank (flash.private_flash_root): disk saves."""
        if memory_root is not None:
            memory_root = private_flash_root(memory_root, rank)
        self.model, self.optimizer, self.client = model, optimizer, client
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.every_steps, self.disk_root, self.memory_root, self.keep = every_steps, Path(disk_root), memory_root, keep
        self.ledger, self.extra_meta = ledger, extra_meta
        self.last_step = last_step
        self.flash = FlashSnapshotter(memory_root, rank, start_step=last_step) if memory_root is not None else None
        self.stalls_s: list[float] = []
        self.saved: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0

    def due(self, step: int) -> bool:
        return self.enabled and step - self.last_step >= self.every_steps

    def save(self, state: LoopState, current: EpochStats | None, progress: dict[str, int]) -> Path:
        """Collective. `progress`: this rank's {task id: rows trained} of the task it holds."""
        t0 = time.perf_counter()
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, progress)
        merged: dict[str, int] = {}
        for p in parts:
            merged.update(p)
        meta: dict[str, Any] = {}
        if self.rank == 0:
            meta = {
                "step": state.step, "generation": self.generation, "world_size": self.world_size,
                "time": time.time(), "kind": "memory" if self.memory_root is not None else "disk",
                "data_state": self.client.snapshot(merged), "loop": loop_to_dict(state, current),
                **(self.extra_meta() if self.extra_meta is not None else {}),
            }
        if self.flash is not None:
            path = self.flash.save(self.model, self.optimizer, state.step, meta)
        else:
            path = save_disk(self.model, self.optimizer, self.disk_root, state.step, rank=self.rank, meta=meta,
                             keep=self.keep)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        self.saved.append(str(path))
        self.last_step = state.step
        if self.ledger is not None:
            self.ledger.mark_checkpoint(state.step)
        if self.rank == 0:
            log.info("checkpoint step %d -> %s (%s): training stalled %.3fs", state.step, path,
                     "flash, shared memory" if self.memory_root is not None else "disk", stall)
        return path

    def summary(self) -> dict[str, Any]:
        return {
            "checkpoints": len(self.stalls_s),
            "kind": "memory" if self.memory_root is not None else "disk",
            "stall_s_median": statistics.median(self.stalls_s) if self.stalls_s else None,
            "stall_s": self.stalls_s,
            **({"flash_full_saves": self.flash.full_saves, "flash_fast_saves": self.flash.fast_saves}
               if self.flash is not None else {}),
        }
