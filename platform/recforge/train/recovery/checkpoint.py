"""The final DCP checkpoint: sharded save from every rank, unsharded load in one process (no process group).

Like a step checkpoint it carries CHECKSUMS.json (sha256 of every file), written before the directory is renamed
into place, and its meta a fingerprint of the model and plan (recforge.train.recovery.layout); `load_unsharded`
verifies both and refuses a corrupt checkpoint or one of another model/plan, naming the file or the difference.
"""
from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from recforge.config import ModelConfig
from recforge.train.model import build_dlrm
from recforge.train.recovery.layout import (
    FINGERPRINT_KEY,
    META_FILE,
    CheckpointIncompatible,
    check_compatible,
    fingerprint,
    verify_checkpoint,
    write_checksums,
)

log = logging.getLogger(__name__)


def save_checkpoint(
    model: torch.nn.Module, optimizer: Any, ckpt_dir: str | Path, *, rank: int, meta: dict[str, Any] | None = None
) -> Path:
    """Collective: every rank writes its shards into `<ckpt_dir>.tmp`; after a barrier rank 0 writes the meta
    (with `meta["fingerprint"]`, layout.fingerprint, when the caller gives one) and CHECKSUMS.json, then renames it
    to `ckpt_dir` (replacing an older checkpoint), so a crash never leaves a half or unchecked checkpoint there."""
    final = Path(ckpt_dir)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        (tmp / META_FILE).write_text(json.dumps(meta or {}, indent=2, default=str))
        write_checksums(tmp)
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint saved to %s", final)
    dist.barrier()
    return final


def load_unsharded(
    model_cfg: ModelConfig, tables: Sequence[tuple[str, int]], num_dense: int, ckpt_dir: str | Path,
    plan: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """A plain (unsharded, CPU) model with the checkpoint's weights, whatever world size saved it. Raises
    CheckpointCorrupt naming the file whose bytes do not match CHECKSUMS.json, and CheckpointIncompatible when the
    checkpoint's fingerprint is of another model config, tables or (with `plan`, Plan.model_dump) plan."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / ".metadata").exists():
        raise FileNotFoundError(f"no DCP checkpoint in {ckpt_dir} (missing .metadata)")
    verify_checkpoint(ckpt_dir)
    meta = read_meta(ckpt_dir)
    current = fingerprint(model_cfg.model_dump(mode="json"), tables, num_dense, plan)
    if plan is None and isinstance(meta.get(FINGERPRINT_KEY), dict):  # no plan given: that part is not checked
        current["plan_sha256"] = meta[FINGERPRINT_KEY].get("plan_sha256")
    why = check_compatible(meta, current)
    if why is not None:
        raise CheckpointIncompatible(f"checkpoint {ckpt_dir} is of another model or plan: {why}")
    model = build_dlrm(model_cfg, [(name, rows) for name, rows in tables], num_dense, "cpu")
    state = {"model": model.state_dict()}
    saved = _saved_shapes(ckpt_dir)
    problems = []
    for k, v in state["model"].items():
        got = saved.get(f"model.{k}")
        if got is None:
            problems.append(f"{k}: not in the checkpoint")
        elif got != tuple(v.shape):
            problems.append(f"{k}: checkpoint shape {got}, model shape {tuple(v.shape)}")
    if problems:
        raise ValueError(f"checkpoint {ckpt_dir} does not match the model ({len(problems)} problems): {problems[:5]}")
    with warnings.catch_warnings():  # "torch.distributed is disabled...": single-process load is the point
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval()


def _saved_shapes(ckpt_dir: Path) -> dict[str, tuple[int, ...] | None]:
    meta = dcp.FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    return {k: tuple(m.size) if hasattr(m, "size") else None for k, m in meta.items()}


def read_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}
