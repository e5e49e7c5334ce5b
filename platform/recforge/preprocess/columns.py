"""What executors pass between ops, how they read a RawBatch and how they assemble their output.

A `Col` is one feature's values: fixed width (values [B, w]) or jagged (values [N] + lengths [B]). The output of
every executor is (dense float32[B, Fd], KeyedJaggedTensor of the sparse features in plan order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.planning.plan import Plan

SourceKind = Literal["dense", "sparse"]


class BatchError(ValueError):
    """A raw batch does not fit the dataset / plan; the message names the column (or feature)."""


@dataclass(frozen=True)
class Col:
    values: Tensor  # fixed: [B, w]; jagged: [N]
    lengths: Tensor | None = None  # jagged only: int64 [B]

    @property
    def jagged(self) -> bool:
        return self.lengths is not None

    def flat(self) -> Tensor:
        return self.values.reshape(-1)

    def row_lengths(self, rows: int) -> Tensor:
        if self.lengths is not None:
            return self.lengths
        return torch.full((rows,), self.values.shape[1], dtype=torch.int64, device=self.values.device)


@dataclass(frozen=True)
class Source:
    """Where a plan's source column lives in a RawBatch."""

    kind: SourceKind  # the dataset's column kind
    index: int  # column of raw.dense / raw.sparse


def sources(dataset: DatasetConfig) -> dict[str, Source]:
    out = {n: Source("dense", j) for j, n in enumerate(dataset.dense_names)}
    out |= {n: Source("sparse", j) for j, n in enumerate(dataset.sparse_names)}
    return out


def check_batch(raw: RawBatch, dataset: DatasetConfig, plan: Plan) -> None:
    """BatchError naming the column when the batch's columns do not match the dataset the plan was built for."""
    b = raw.rows
    for kind, values, valid, names in (("dense", raw.dense, raw.dense_valid, dataset.dense_names),
                                       ("sparse", raw.sparse, raw.sparse_valid, dataset.sparse_names)):
        if values.dim() != 2 or values.shape[0] != b or values.shape[1] != len(names):
            have = values.shape[1] if values.dim() == 2 else "?"
            missing = names[have:] if isinstance(have, int) and have < len(names) else []
            raise BatchError(
                f"raw batch has {have} {kind} columns, dataset {dataset.name!r} has {len(names)}"
                + (f" (missing {missing[:5]})" if missing else "")
            )
        allowed = (torch.int64, torch.float64) if kind == "dense" else (torch.int64,)
        if values.dtype not in allowed:
            want = "int64 or float64" if kind == "dense" else "int64"
            raise BatchError(f"raw batch {kind} columns {names[:3]}...: must be {want}, got {values.dtype}")
        if valid.shape != values.shape or valid.dtype != torch.bool:
            raise BatchError(f"raw batch {kind}_valid must be bool {list(values.shape)}, got {valid.dtype} "
                             f"{list(valid.shape)}")
    sparse = set(dataset.sparse_names)
    for name, col in raw.jagged.items():
        if name not in sparse:
            raise BatchError(f"raw batch list column {name!r} is not a sparse column of dataset {dataset.name!r}")
        if col.rows != b:
            raise BatchError(f"raw batch list column {name!r} has {col.rows} rows, the batch {b}")
        if col.values.dtype != torch.int64:
            raise BatchError(f"raw batch list column {name!r} must hold int64 ids, got {col.values.dtype}")


def finish(plan: Plan, outputs: dict[str, Col], rows: int, device: torch.device) -> tuple[Tensor, KeyedJaggedTensor]:
    """Feature outputs -> (dense float32[B, Fd], KJT keyed by the plan's sparse features, values key-major)."""
    dense_cols = []
    for name in plan.dense_features():
        col = outputs[name]
        if col.lengths is not None and bool((col.lengths != 1).any()):
            raise BatchError(f"dense feature {name!r}: its list source gives rows without exactly one value; "
                             "a dense feature needs one value per row (end its chain with firstx(1) and "
                             "make sure no list is empty)")
        dense_cols.append(col.values if col.jagged else col.values[:, 0])  # a view: stack_columns reads strides
    if dense_cols and rows:
        dense = torch.ops.recforge.stack_columns(dense_cols)  # one tiled pass, not a strided cat
    else:
        dense = torch.zeros((rows, len(dense_cols)), dtype=torch.float32, device=device)
    keys = plan.sparse_features()
    cols = [outputs[k] for k in keys]
    values = torch.cat([c.flat() for c in cols]) if cols else torch.zeros(0, dtype=torch.int64, device=device)
    if any(c.jagged for c in cols):
        lengths = torch.cat([c.row_lengths(rows).to(torch.int32) for c in cols])
    else:  # fixed widths: one repeat instead of a tensor per feature
        widths = torch.tensor([c.values.shape[1] for c in cols], dtype=torch.int32, device=device)
        lengths = torch.repeat_interleave(widths, rows)
    kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=rows)
    return dense.to(torch.float32), kjt
