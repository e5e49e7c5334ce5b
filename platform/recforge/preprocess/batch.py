"""RawBatch: one shard RecordBatch as torch tensors (values + validity masks), the input of every executor."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

from recforge.config import DatasetConfig


@dataclass(frozen=True)
class RawBatch:
    label: Tensor  # float32[B]
    dense: Tensor  # int64[B, Fd], nulls as 0
    dense_valid: Tensor  # bool[B, Fd]
    sparse: Tensor  # int64[B, Fs], nulls as 0
    sparse_valid: Tensor  # bool[B, Fs]

    @property
    def rows(self) -> int:
        return int(self.label.shape[0])

    @classmethod
    def from_arrow(cls, rb: pa.RecordBatch | pa.Table, dataset: DatasetConfig) -> "RawBatch":
        """Columns are looked up by name (dataset order); integer columns, nulls -> 0 with valid False."""
        names = set(rb.schema.names)
        missing = [n for n in [dataset.label, *dataset.dense_names, *dataset.sparse_names] if n not in names]
        if missing:
            raise ValueError(f"RawBatch.from_arrow: columns missing from the batch: {missing}")
        label_col = _column(rb, dataset.label)
        if label_col.null_count:
            raise ValueError(f"RawBatch.from_arrow: label column {dataset.label!r} has {label_col.null_count} nulls")
        label = _values(label_col, dataset.label)
        bad = int(np.count_nonzero((label != 0) & (label != 1)))
        if bad:
            raise ValueError(f"RawBatch.from_arrow: label column {dataset.label!r} has {bad} values not in {{0, 1}}")
        dense, dense_valid = _matrix(rb, dataset.dense_names)
        sparse, sparse_valid = _matrix(rb, dataset.sparse_names)
        return cls(
            label=torch.from_numpy(label.astype(np.float32)),
            dense=dense, dense_valid=dense_valid, sparse=sparse, sparse_valid=sparse_valid,
        )

    def to(self, device: torch.device | str) -> "RawBatch":
        return RawBatch(*(t.to(device) for t in (self.label, self.dense, self.dense_valid, self.sparse,
                                                 self.sparse_valid)))

    def pad_to(self, n: int) -> tuple["RawBatch", Tensor]:
        """A new batch of n rows (zero rows appended, valid False) and weight float32[n]: 1 real, 0 padding."""
        b = self.rows
        if n < b:
            raise ValueError(f"RawBatch.pad_to: cannot pad {b} rows down to {n}")
        pad = n - b

        def grow(t: Tensor) -> Tensor:
            return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t.clone()

        weight = torch.cat([torch.ones(b, dtype=torch.float32), torch.zeros(pad, dtype=torch.float32)])
        padded = RawBatch(grow(self.label), grow(self.dense), grow(self.dense_valid), grow(self.sparse),
                          grow(self.sparse_valid))
        return padded, weight


def _column(rb: pa.RecordBatch | pa.Table, name: str) -> pa.Array:
    col = rb.column(name)
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _values(col: pa.Array, name: str) -> np.ndarray:
    if not pa.types.is_integer(col.type):
        raise TypeError(f"RawBatch.from_arrow: column {name!r} must be an integer type, got {col.type}")
    filled = pc.fill_null(col, 0) if col.null_count else col
    return filled.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _matrix(rb: pa.RecordBatch | pa.Table, names: list[str]) -> tuple[Tensor, Tensor]:
    rows = rb.num_rows
    if not names:
        return torch.zeros((rows, 0), dtype=torch.int64), torch.zeros((rows, 0), dtype=torch.bool)
    cols = [_column(rb, n) for n in names]
    values = np.stack([_values(c, n) for c, n in zip(cols, names)], axis=1)
    valid = np.stack([c.is_valid().to_numpy(zero_copy_only=False) for c in cols], axis=1)
    return torch.from_numpy(values), torch.from_numpy(valid)
