"""Predictions of the trained (sharded) model on a fixed batch: the first rows of shard 0.

Every rank must run it (the sharded forward is collective); the checkpoint test recomputes the same
rows with the unsharded model loaded from the checkpoint and compares.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from recforge.config import DatasetConfig
from recforge.data.shards import open_manifest, read_rows
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import Executor


def probe_rows(manifest_dir: str | Path, batch_size: int) -> tuple[int, int, int]:
    """(shard, row_start, row_end) of the probe batch."""
    manifest = open_manifest(manifest_dir)
    return 0, 0, min(batch_size, manifest.shards[0].rows if manifest.shards else 0)


@torch.no_grad()
def probe_logits(
    model: torch.nn.Module, manifest_dir: str | Path, dataset: DatasetConfig, executor: Executor, batch_size: int,
    device: torch.device,
) -> dict[str, Any]:
    shard, start, end = probe_rows(manifest_dir, batch_size)
    if end == 0:  # no data at all (every rank sees the same manifest, so all skip the forward)
        return {"shard": shard, "row_start": 0, "row_end": 0, "logits": torch.zeros(0)}
    raw = RawBatch.from_arrow(read_rows(manifest_dir, shard, start, end), dataset)
    padded, _ = raw.pad_to(batch_size)  # every rank's forward needs the same batch size
    was_training = model.training
    model.eval()
    dense, kjt = executor(padded.to(device))
    logits = model(dense, kjt).reshape(-1)[: raw.rows].float().cpu()
    model.train(was_training)
    return {"shard": shard, "row_start": start, "row_end": end, "logits": logits}
