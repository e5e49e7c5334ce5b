"""`preprocessing: offline`: the training manifest preprocessed before training starts (the input of RAP's
"Ideal"), then trained from the preprocessed rows. The baseline co-running is measured against.

preprocess_manifest(manifest_dir, plan, dataset, out_dir)
    per shard one file shard-NNNNN.pt {labels float32[N], dense float32[N, Fd], ids int64[N, W]}: the plan's
    sparse features side by side (feature k in columns [offset_k, offset_k + width_k)); pad.pt, what a padding
    row of a raw batch preprocesses to; index.json {shard rows, keys, widths}.
OfflineTaskBatches
    TaskBatches reading a task's rows from those files and padding batches with the padding row, so a batch
    holds the values inline preprocessing of the same padded raw rows gives.

Fixed-width features only (every RAP plan keeps a fixed number of ids per row): a plan whose feature gives a
varying number of ids per row (a list column without firstx) is refused, the feature named.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import DatasetConfig
from recforge.data.manifest import Manifest
from recforge.data.schema import empty_batch
from recforge.data.shards import read_rows
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import make_executor
from recforge.preprocess.planning.plan import Plan
from recforge.train.loop.batches import Batch, TaskBatches, TaskClient

INDEX_FILE = "index.json"
PAD_FILE = "pad.pt"


class OfflineError(ValueError):
    """The plan or the preprocessed data does not fit offline training; the message names the feature / file."""


@dataclass(frozen=True)
class PreprocessedRows:
    """Preprocessed rows of one task; every field has rows on dim 0 (TaskBatches slices them)."""

    label: Tensor
    dense: Tensor
    ids: Tensor

    @property
    def rows(self) -> int:
        return int(self.label.shape[0])


def _as_matrix(kjt: KeyedJaggedTensor, rows: int) -> tuple[Tensor, list[int]]:
    """KJT (values key-major) -> ids [rows, W] and the per-key widths; OfflineError on a varying width."""
    blocks, widths = [], []
    lengths = kjt.lengths().view(len(kjt.keys()), rows) if rows else kjt.lengths().view(len(kjt.keys()), 0)
    offset = 0
    for k, key in enumerate(kjt.keys()):
        row_len = lengths[k]
        w = int(row_len[0]) if rows else 0
        if rows and bool((row_len != w).any()):
            raise OfflineError(f"offline preprocessing: feature {key!r} gives "
                               f"{int(row_len.min())}..{int(row_len.max())} ids per row; "
                               "offline training needs a fixed number (end its chain with firstx)")
        blocks.append(kjt.values()[offset:offset + rows * w].view(rows, w))
        offset += rows * w
        widths.append(w)
    return torch.cat(blocks, dim=1), widths


def preprocess_manifest(manifest_dir: str | Path, plan: Plan, dataset: DatasetConfig, out_dir: str | Path,
                        executor: str = "fused") -> dict[str, Any]:
    ex = make_executor(executor, plan, dataset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pad_raw, _ = RawBatch.from_arrow(empty_batch(dataset), dataset).pad_to(1)
    pad_dense, pad_kjt = ex(pad_raw)
    pad_ids, widths = _as_matrix(pad_kjt, 1)
    torch.save({"dense": pad_dense[0], "ids": pad_ids[0]}, out / PAD_FILE)
    manifest = Manifest.load(manifest_dir)
    rows = []
    for i, shard in enumerate(manifest.shards):
        raw = RawBatch.from_arrow(read_rows(manifest_dir, i, 0, shard.rows), dataset)
        dense, kjt = ex(raw)
        ids, w = _as_matrix(kjt, raw.rows)
        if raw.rows and w != widths:
            raise OfflineError(f"offline preprocessing: shard {i} gives widths {w}, the padding row {widths}")
        torch.save({"labels": raw.label, "dense": dense, "ids": ids}, out / f"shard-{i:05d}.pt")
        rows.append(raw.rows)
    index = {"shard_rows": rows, "keys": plan.sparse_features(), "widths": widths, "plan": plan.name}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1))
    return index


class OfflineTaskBatches(TaskBatches):
    def __init__(self, client: TaskClient, preprocessed_dir: str | Path, dataset: DatasetConfig, batch_size: int,
                 device: torch.device, ledger=None) -> None:
        # no executor: the rows are preprocessed already (TaskBatches is typed for raw rows, see read_task)
        super().__init__(client, preprocessed_dir, dataset, None, batch_size, device,  # type: ignore[arg-type]
                         ledger=ledger)
        root = Path(preprocessed_dir)
        if not (root / INDEX_FILE).exists():
            raise OfflineError(f"offline training: no preprocessed data at {root} ({INDEX_FILE} missing)")
        self.index = json.loads((root / INDEX_FILE).read_text())
        self.keys, self.widths = self.index["keys"], self.index["widths"]
        self.pad = torch.load(root / PAD_FILE, weights_only=True)
        self._shard: tuple[int, dict] | None = None

    # TaskBatches only slices a task's rows and counts them (rows, dataclass fields): PreprocessedRows has both,
    # but its methods are typed for RawBatch
    def read_task(self, task) -> PreprocessedRows:  # type: ignore[override]
        if self._shard is None or self._shard[0] != task.shard:
            path = Path(self.manifest_dir) / f"shard-{task.shard:05d}.pt"
            self._shard = (task.shard, torch.load(path, weights_only=True))
        d = self._shard[1]
        a, b = task.row_start, task.row_end
        if b > d["labels"].shape[0]:
            raise RuntimeError(f"task {task.task_id}: rows [{a}, {b}) beyond the {d['labels'].shape[0]} preprocessed "
                               f"rows of shard {task.shard}")
        return PreprocessedRows(d["labels"][a:b], d["dense"][a:b], d["ids"][a:b])

    def prepare(self, rows: PreprocessedRows) -> Batch:  # type: ignore[override]  # see read_task
        n, pad = rows.rows, self.batch_size - rows.rows
        dense = torch.cat([rows.dense, self.pad["dense"].expand(pad, -1)]) if pad else rows.dense
        ids = torch.cat([rows.ids, self.pad["ids"].expand(pad, -1)]) if pad else rows.ids
        cols, start = [], 0
        for w in self.widths:
            cols.append(ids[:, start:start + w].reshape(-1))
            start += w
        kjt = KeyedJaggedTensor(keys=list(self.keys), values=torch.cat(cols) if cols else ids.new_zeros(0),
                                lengths=torch.repeat_interleave(torch.tensor(self.widths, dtype=torch.int32),
                                                                self.batch_size),
                                stride=self.batch_size)
        labels = torch.cat([rows.label, rows.label.new_zeros(pad)])
        weights = torch.cat([torch.ones(n), torch.zeros(pad)])
        return Batch(dense=dense.to(self.device), sparse=kjt.to(self.device), labels=labels.to(self.device),
                     weights=weights.to(self.device), real=n)
