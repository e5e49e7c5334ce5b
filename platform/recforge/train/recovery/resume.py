"""Resumable step checkpoints: model + optimizer (DCP, any world size) + the data state + loop state.

A checkpoint is a directory `step-<step>` holding a torch.distributed.checkpoint (DCP) save of
{"model": DMP state_dict, "optim": KeyedOptimizer state_dict}, and `recforge_checkpoint.json`
with the step, the saving generation and world size, the training loop's counters and the job
master's *data state* at that step (`TaskQueue.snapshot`: DONE tasks, plus the trained prefix of
every task in flight). Two places hold them:

* disk (`<checkpoint_dir>.steps/step-N`): complete only with `CHECKSUMS.json` (sha256 of every file),
  written last; the newest `keep` are kept.
* shared memory (`/dev/shm/recforge-flash-XXXXXXXX/step-N`, a flash checkpoint, recforge.train.recovery.flash):
  complete when every saving rank left its `done-rank<r>` marker. The directory is the job's private one (0700, this
  uid; recforge.train.recovery.private_dir); one another user could write is refused, naming it, and only the disk
  checkpoints are candidates (DCP unpickles a checkpoint's metadata: docs/security.md).

Restart (`load_latest`, collective): the newest checkpoint that every rank can use and that passes
its check is loaded (memory before disk at the same step); a corrupt one is skipped with a warning
naming the problem, falling back to the previous one. DCP reshards on load, so a checkpoint saved at
one world size (and sharding plan) loads into another. Then rank 0 rolls the master back to the
checkpoint's data state (no checkpoint: to the start).

Guarantee (documented in docs of recforge.train.loop.ledger too): the final model has been trained on
every row of every epoch exactly once; rows trained by a failed group after the checkpoint it was
resumed from (the work in flight at the failure) were trained once more in the lost timeline, and
the master hands them out again.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from recforge.train.loop.step_loop import EpochStats, LoopState
from recforge.train.recovery.layout import (
    MEMORY,
    META_FILE,
    Candidate,
    candidates,
    checkpoint_problem,
    disk_problem,
    memory_problem,
    prune,
    read_meta,
    step_name,
    write_checksums,
)
from recforge.train.recovery.private_dir import make_private_root, private_dir_problem

log = logging.getLogger(__name__)

@dataclass
class Restored:
    path: Path
    step: int
    source: str
    meta: dict[str, Any]
    skipped: list[tuple[str, str]]  # (path, why) of newer checkpoints that could not be used


# ---- loop state ----------------------------------------------------------------------------
def loop_to_dict(state: LoopState, current: EpochStats | None) -> dict[str, Any]:
    return {
        "step": state.step,
        "last_window_loss": state.last_window_loss,
        "epochs": [asdict(e) for e in state.epochs],
        "current": asdict(current) if current is not None else None,
    }


def loop_from_dict(d: dict[str, Any]) -> tuple[LoopState, EpochStats | None]:
    state = LoopState(step=int(d["step"]), epochs=[EpochStats(**e) for e in d["epochs"]],
                      last_window_loss=float(d.get("last_window_loss", float("nan"))))
    cur = d.get("current")
    return state, (EpochStats(**cur) if cur is not None else None)


# ---- save ----------------------------------------------------------------------------------
class CheckpointSaveError(RuntimeError):
    """A step checkpoint could not be written (full disk, I/O error): names the checkpoint and each rank's error."""


def training_state(model: Any, optimizer: Any) -> dict[str, Any]:
    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    return state


def save_disk(model: Any, optimizer: Any, root: Path, step: int, *, rank: int, meta: dict[str, Any],
              keep: int) -> Path:
    """Collective: a disk step checkpoint written into `step-N.tmp`, checksummed, renamed into place."""
    root = Path(root)
    final = root / step_name(step)
    tmp = root / (step_name(step) + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        make_private_root(root)  # 0700 when created here
        tmp.mkdir()
    dist.barrier()
    try:
        dcp.save(training_state(model, optimizer), storage_writer=FileSystemWriter(str(tmp)))
    except CheckpointException as e:  # a BaseException (e.g. a full disk on some rank), raised on every rank
        space = _space_note(root)  # before the partial save is removed: a full disk shows as a torch zip error
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        why = "; ".join(f"rank {r}: {type(x).__name__}: {str(x)[:200]}" for r, (x, _) in sorted(e.failures.items()))
        raise CheckpointSaveError(f"step checkpoint {final} could not be written ({why}){space}; the partial save "
                                  f"was removed, the older checkpoints are kept") from e
    dist.barrier()
    if rank == 0:
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, default=str))
        write_checksums(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a rolled-back timeline may reach the same step again
        os.replace(tmp, final)
        prune(root, keep)
    dist.barrier()
    return final


def _space_note(root: Path) -> str:
    """'; no space left on the device of <root> (N bytes free)' when its file system is (nearly) full, else ''."""
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return ""
    if usage.free < max(1 << 20, usage.total // 100):
        return f"; no space left on the device of {root} ({usage.free} of {usage.total} bytes free)"
    return ""


# ---- load ----------------------------------------------------------------------------------
def _usable_here(c: Candidate) -> bool:
    if c.source == MEMORY:
        return memory_problem(c.path) is None
    return disk_problem(c.path, deep=False) is None


def _load_into(model: Any, optimizer: Any, path: Path) -> list[str]:
    """Collective DCP load; returns warnings (optimizer state missing after a sharding change)."""
    warnings: list[str] = []
    sd = {"model": model.state_dict()}
    dcp.load(sd, storage_reader=FileSystemReader(str(path)))
    model.load_state_dict(sd["model"])
    if optimizer is None:
        return warnings
    optimizer.init_state()  # materialize lazy state (Adam moments) so DCP can load into it in place
    osd = {"optim": optimizer.state_dict()}
    try:
        dcp.load(osd, storage_reader=FileSystemReader(str(path)))
    except Exception as e:  # a table moved between the fused and the plain kernel: its state differs
        warnings.append(f"optimizer state partly missing in {path.name} ({str(e)[:200]}); missing parts start fresh")
        osd = {"optim": optimizer.state_dict()}
        dcp.load(osd, storage_reader=FileSystemReader(str(path)), planner=DefaultLoadPlanner(allow_partial_load=True))
    optimizer.load_state_dict(osd["optim"])
    return warnings


def load_latest(model: Any, optimizer: Any, *, rank: int, disk_root: Path | None,
                memory_root: Path | None, fingerprint: Mapping[str, Any] | None = None) -> Restored | None:
    """Collective: load the newest usable checkpoint into the (sharded) model and optimizer.

    Falls back past checkpoints that are incomplete, corrupt (checksum), of another model or plan (with
    `fingerprint`, this run's: layout.fingerprint) or fail to load, logging one warning line each. Returns
    None when there is none (training starts from the initial weights).
    Raises RuntimeError when a load failed and no older checkpoint is left (the weights may be
    partly overwritten: starting from them would be silently wrong).
    A `memory_root` that is not a private directory of this user is refused (logged) on the ranks that see it so:
    its snapshots are candidates on no rank."""
    memory_root = _private_memory_root(memory_root, rank)
    mine = {(str(c.path), c.source) for c in candidates(disk_root, memory_root) if _usable_here(c)}
    world = dist.get_world_size()
    views: list[Any] = [None] * world
    dist.all_gather_object(views, mine)
    usable = set.intersection(*views)
    skipped: list[tuple[str, str]] = []
    tried: set[str] = set()
    load_failed = False
    while True:
        choice: list[Any] = [None]
        if rank == 0:
            for c in candidates(disk_root, memory_root):
                if str(c.path) in tried:
                    continue
                if (str(c.path), c.source) not in usable:
                    why = (memory_problem(c.path) if c.source == MEMORY else disk_problem(c.path, deep=False)) \
                        or "not visible to every rank"
                    _skip(skipped, c, why)
                    tried.add(str(c.path))
                    continue
                problem = checkpoint_problem(c.path, c.source, fingerprint)
                if problem is not None:
                    _skip(skipped, c, problem)
                    tried.add(str(c.path))
                    continue
                choice = [c]
                break
        dist.broadcast_object_list(choice, src=0)
        c = choice[0]
        if c is None:
            if load_failed:
                raise RuntimeError(f"no checkpoint could be loaded (tried {sorted(tried)}); the model may be partly "
                                   f"overwritten, refusing to train from it")
            if rank == 0:
                log.warning("no usable checkpoint in %s or %s: training starts from the initial weights",
                            disk_root, memory_root)
            return None
        tried.add(str(c.path))
        err = ""
        t0 = time.perf_counter()
        try:
            notes = _load_into(model, optimizer, c.path)
        except Exception as e:
            err, notes = f"{type(e).__name__}: {str(e)[:300]}", []
        flags = [None] * world
        dist.all_gather_object(flags, err)
        errors = [f for f in flags if f]
        if errors:
            load_failed = True
            if rank == 0:
                _skip(skipped, c, f"load failed: {errors[0]}")
            continue
        meta: list[Any] = [read_meta(c.path) if rank == 0 else None]
        dist.broadcast_object_list(meta, src=0)
        if rank == 0:
            for n in notes:
                log.warning("%s", n)
            log.warning("resuming from %s checkpoint %s (step %d, saved by generation %s at world size %s) in %.2fs",
                        c.source, c.path, c.step, meta[0].get("generation"), meta[0].get("world_size"),
                        time.perf_counter() - t0)
        return Restored(path=c.path, step=c.step, source=c.source, meta=meta[0], skipped=skipped)


def _private_memory_root(root: Path | None, rank: int) -> Path | None:
    if root is None:
        return None
    problem = private_dir_problem(root)
    if problem is None:
        return Path(root)
    if os.path.lexists(root):  # absent: no flash checkpoint was taken yet, nothing to refuse
        log.warning("rank %d: refusing flash checkpoint directory %s: %s; loading from the disk checkpoints only",
                    rank, root, problem)
    return None


def _skip(skipped: list[tuple[str, str]], c: Candidate, why: str) -> None:
    skipped.append((str(c.path), why))
    log.warning("checkpoint %s (%s, step %d) is unusable: %s; falling back to the previous one",
                c.path, c.source, c.step, why)
