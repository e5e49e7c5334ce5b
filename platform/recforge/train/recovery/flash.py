"""Flash checkpoints, worker side: a synchronous copy of model + optimizer state into shared memory.

A snapshot is an ordinary DCP checkpoint in a tmpfs directory (`/dev/shm/...`): the first one of a
group is written by torch.distributed.checkpoint (collective planning, so the global metadata that
makes it load resharded exists); every later one takes the fast path (recforge.train.recovery.flash_layout):
each rank copies its tensors' bytes into the same file layout and writes it, with no collective, no
planning and no pickling of tensors. Each rank then leaves a `done-rank<r>` marker (listing the sizes of
the files it wrote, checked on load; the agent's disk copy carries sha256 of every file); rank 0 also
writes the recforge meta and drops snapshots older than the newest complete one. The agent
(recforge.elastic.agent.flash_checkpoint.FlashPersister, in the process that launched the workers)
persists complete snapshots to disk asynchronously, also after a worker died; a restarted group
loads from memory when the snapshot is there (recforge.train.recovery.resume.load_latest).
The shared-memory directory is the job's private one (recforge.train.recovery.private_dir): `private_flash_root`
refuses one another user could write, and the group checkpoints to disk instead.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from recforge.train.recovery.flash_layout import Layout, RecordingWriter
from recforge.train.recovery.layout import META_FILE, memory_problem, step_dirs, step_name, write_done_marker
from recforge.train.recovery.private_dir import UnsafeDirectoryError, ensure_private_dir
from recforge.train.recovery.resume import training_state

log = logging.getLogger(__name__)

AGENT_ENV = "RECFORGE_FLASH_AGENT"  # set by the launching process when it runs a FlashPersister


def agent_present(flash_agent: bool = False) -> bool:
    return flash_agent or bool(os.environ.get(AGENT_ENV))


def private_flash_root(root: str | Path, rank: int) -> Path | None:
    """Collective: `root` (created 0700 when missing) if it is a private directory of this user on every rank; None
    on every rank when any rank refuses it (logged there, naming it and why): the group checkpoints to disk."""
    try:
        ensure_private_dir(root)
        ok = True
    except UnsafeDirectoryError as e:
        log.warning("rank %d: %s; step checkpoints go to disk instead", rank, e)
        ok = False
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return Path(root) if flag.item() else None


class FlashSnapshotter:
    """One per rank and group. `start_step`: the step the group resumed from; snapshots above it in
    shared memory belong to a timeline that died and are removed (rank 0). `root` must be a private directory of
    this user (UnsafeDirectoryError otherwise; `private_flash_root` checks it on every rank first)."""

    def __init__(self, root: Path, rank: int, start_step: int = 0) -> None:
        self.root, self.rank = ensure_private_dir(root), rank
        self.layout: Layout | None = None
        self.fast_ok = True
        self.full_saves = self.fast_saves = 0
        if rank == 0:
            for step, path in step_dirs(self.root):
                if step > start_step:
                    shutil.rmtree(path, ignore_errors=True)

    def save(self, model: Any, optimizer: Any, step: int, meta: dict[str, Any]) -> Path:
        """Collective: snapshot into `root/step-N`; returns its path."""
        path = self.root / step_name(step)
        state = training_state(model, optimizer)
        layout = self.layout
        # every rank agreed (MIN), so when `fast` holds this rank's layout and sources are not None
        fast = self._agree(layout is not None and self.fast_ok)
        sources = None
        if fast and layout is not None:
            sources = layout.sources(state)
            fast = self._agree(sources is not None)
            if not fast and self.rank == 0:
                log.info("flash checkpoint layout changed at step %d: full DCP save", step)
        if fast and layout is not None and sources is not None:
            path.mkdir(parents=True, exist_ok=True)
            layout.write(path, sources, with_metadata=self.rank == 0)
            self.fast_saves += 1
        else:
            self._full_save(state, path)
        if self.rank == 0:
            (path / META_FILE).write_text(json.dumps(meta, default=str))
        write_done_marker(path, self.rank)  # with the sizes of the files this rank wrote
        if self.rank == 0:
            self._drop_older(step)
        return path

    def _full_save(self, state: dict[str, Any], path: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        dist.barrier()
        writer = RecordingWriter(str(path))
        dcp.save(state, storage_writer=writer)
        self.full_saves += 1
        try:
            layout = Layout(path, writer.recorded)
            ok = layout.verify(state)
        except (ValueError, KeyError, OSError, zipfile.BadZipFile) as e:
            layout, ok = None, False
            log.warning("flash fast path unavailable (%s): every snapshot is a full DCP save", e)
        if ok and layout is not None:
            layout.keep_headers_only()  # the payloads are the state's bytes: each fast save copies them from the state
        self.layout = layout if ok else None
        if not ok and layout is not None:
            log.warning("flash fast path disabled: the recorded layout does not reproduce the state's bytes")
        self.fast_ok = ok

    def _agree(self, mine: bool) -> bool:
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _drop_older(self, step: int) -> None:
        """Keep the newest complete snapshot below `step` (the one a crash now would fall back to)."""
        older = [(s, p) for s, p in step_dirs(self.root) if s < step]
        keep = next((s for s, p in reversed(older) if memory_problem(p) is None), None)
        for s, p in older:
            if s != keep:
                shutil.rmtree(p, ignore_errors=True)
