"""Warm start inside the worker: load another run's final DCP checkpoint (the champion's model and optimizer state)
into this group's freshly sharded model before the first step. DCP reshards on load, so any world size and sharding
plan that saved it loads here. Called only when the run has no step checkpoint of its own (a retry or relaunch
resumes its own first); the train stage chose and checked the checkpoint (recforge.pipelines.hooks.warm_start)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from recforge.train.recovery.checkpoint import read_meta

log = logging.getLogger(__name__)

MARKER = "warm_start.json"  # recforge.pipelines.hooks.warm_start.MARKER


def load_init_checkpoint(model: Any, optimizer: Any, path: str | Path, *, rank: int, world_size: int,
                         output_dir: str | Path) -> dict[str, Any]:
    """Collective: every rank loads its part of `path`; rank 0 writes output_dir/MARKER. Raises on every rank when
    any rank failed (the weights may be partly overwritten: training from them would be silently wrong)."""
    path = Path(path)
    t0 = time.perf_counter()
    err, notes = "", []
    try:
        notes = _load(model, optimizer, path)
    except Exception as e:  # gathered below so that every rank raises, none waits in a collective
        err = f"{type(e).__name__}: {str(e)[:300]}"
    errors: list[Any] = [None] * world_size
    dist.all_gather_object(errors, err)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed:
        raise RuntimeError(f"warm start: loading the init checkpoint {path} failed ({'; '.join(failed)})")
    info = {"path": str(path), "saved_world_size": read_meta(path).get("world_size"), "world_size": world_size,
            "load_s": time.perf_counter() - t0, "notes": notes}
    if rank == 0:
        for n in notes:
            log.warning("%s", n)
        log.warning("warm start: loaded %s (saved at world size %s) at world size %d in %.2fs", path,
                    info["saved_world_size"], world_size, info["load_s"])
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).write_text(json.dumps(info, indent=1))
    return info


def _load(model: Any, optimizer: Any, path: Path) -> list[str]:
    sd = {"model": model.state_dict()}
    dcp_load(sd, storage_reader=FileSystemReader(str(path)))
    model.load_state_dict(sd["model"])
    if optimizer is None:
        return []
    optimizer.init_state()  # materialize lazy state (Adam moments) so DCP can load into it in place
    osd = {"optim": optimizer.state_dict()}
    notes = []
    try:
        dcp_load(osd, storage_reader=FileSystemReader(str(path)))
    except Exception as e:  # a table on another embedding kernel here than in the saved plan: its state differs
        notes.append(f"warm start: optimizer state partly missing in {path} ({str(e)[:200]}); missing parts start "
                     f"fresh")
        osd = {"optim": optimizer.state_dict()}
        dcp_load(osd, storage_reader=FileSystemReader(str(path)), planner=DefaultLoadPlanner(allow_partial_load=True))
    optimizer.load_state_dict(osd["optim"])
    return notes
