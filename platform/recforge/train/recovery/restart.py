"""A worker group's start: load the newest usable checkpoint and roll the job master back to it.

The model a group starts from and the master's record of which rows are trained must agree: rows
trained into a model that died with its process are not in the checkpoint, so they must be handed
out again. Rank 0 therefore always `restore`s the master to the loaded checkpoint's data state, or
to the very start when there is no checkpoint (the model starts from its initial weights).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from recforge.train.loop.step_loop import EpochStats, LoopState
from recforge.train.recovery.resume import Restored, load_latest, loop_from_dict

log = logging.getLogger(__name__)


@dataclass
class GroupStart:
    state: LoopState
    current: EpochStats | None  # counters of the epoch the checkpoint was taken in (None: at an epoch boundary)
    start_epoch: int
    restored: Restored | None


def resume_group(model: Any, optimizer: Any, client: Any, *, rank: int, disk_root: Path,
                 memory_root: Path | None, reason: str, fingerprint: Mapping[str, Any] | None = None) -> GroupStart:
    """Collective: every rank calls it after sharding the model and before any rank leases a task. With
    `fingerprint` (this run's model/plan), a checkpoint of another model or plan is skipped with the reason."""
    restored = load_latest(model, optimizer, rank=rank, disk_root=disk_root, memory_root=memory_root,
                           fingerprint=fingerprint)
    box: list[Any] = [None]
    if rank == 0:
        data_state = restored.meta.get("data_state") if restored is not None else None
        why = f"{reason}: checkpoint {restored.path} (step {restored.step})" if restored else f"{reason}: no checkpoint"
        summary = client.restore(data_state, reason=why)
        box = [{"epoch": int(summary["epoch"]), "loop": restored.meta.get("loop") if restored else None}]
    dist.broadcast_object_list(box, src=0)
    start_epoch = box[0]["epoch"]
    if box[0]["loop"] is None:
        return GroupStart(LoopState(), None, start_epoch, restored)
    state, current = loop_from_dict(box[0]["loop"])
    if current is not None and current.epoch < start_epoch:
        state.epochs.append(current)  # the checkpoint's data state had completed that epoch
        current = None
    return GroupStart(state, current, start_epoch, restored)
