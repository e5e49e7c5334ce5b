"""RawBatch: one shard RecordBatch as torch tensors (values + validity masks), the input of every executor.

Scalar columns are [B, F] matrices in dataset order (row-major, contiguous). A sparse column stored as a list
(multi-hot, Arrow list<int>) goes into `jagged` (values + lengths, see jagged.py); its slot in `sparse` holds 0 /
invalid. `dense` is int64 when every dense column of the dataset is an integer one (Criteo), else float64 (int
columns converted: exact up to 2**53); executors take either.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import Tensor

from recforge.config import DatasetConfig
from recforge.preprocess.jagged import JaggedColumn, JaggedColumns

INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class RawBatch:
    label: Tensor  # float32[B]
    dense: Tensor  # int64[B, Fd] (float64 when the dataset has a float dense column), nulls as 0
    dense_valid: Tensor  # bool[B, Fd]
    sparse: Tensor  # int64[B, Fs], nulls as 0
    sparse_valid: Tensor  # bool[B, Fs]
    jagged: JaggedColumns = field(default_factory=JaggedColumns)  # list-valued sparse columns by name

    @property
    def rows(self) -> int:
        return int(self.label.shape[0])

    @classmethod
    def from_arrow(cls, rb: pa.RecordBatch | pa.Table, dataset: DatasetConfig) -> RawBatch:
        """Columns are looked up by name (dataset order), nulls -> 0 with valid False. Integer columns (label, ids,
        int dense); a float dense column (any Arrow float or integer type) makes `dense` float64, and its NaNs count
        as missing (valid False), as pandas and NVTabular read them."""
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
        for n in dataset.dense_names:
            if _is_list(_column(rb, n).type):
                raise TypeError(f"RawBatch.from_arrow: dense column {n!r} must be a scalar numeric column, "
                                f"got {_column(rb, n).type}")
        lists = [n for n in dataset.sparse_names if _is_list(_column(rb, n).type)]
        floats = {f.name for f in dataset.dense if f.dtype == "float"}
        if floats:
            dense, dense_valid = _float_matrix(rb, dataset.dense_names, floats)
        else:
            dense, dense_valid = _matrix(rb, dataset.dense_names, set())
        sparse, sparse_valid = _matrix(rb, dataset.sparse_names, set(lists))
        return cls(
            label=torch.from_numpy(label.astype(np.float32)),
            dense=dense, dense_valid=dense_valid, sparse=sparse, sparse_valid=sparse_valid,
            jagged=JaggedColumns({n: _jagged(_column(rb, n), n) for n in lists}),
        )

    def to(self, device: torch.device | str) -> RawBatch:
        return RawBatch(label=self.label.to(device), dense=self.dense.to(device),
                        dense_valid=self.dense_valid.to(device), sparse=self.sparse.to(device),
                        sparse_valid=self.sparse_valid.to(device), jagged=self.jagged.to(device))

    @classmethod
    def concat(cls, parts: list[RawBatch]) -> RawBatch:
        """The rows of `parts` one after another (RAP's global batch from the ranks' local batches)."""
        if not parts:
            raise ValueError("RawBatch.concat: no parts")

        def cat(name: str):
            values = [getattr(p, name) for p in parts]
            return JaggedColumns.concat(values) if isinstance(values[0], JaggedColumns) else torch.cat(values)

        return cls(**{f.name: cat(f.name) for f in fields(cls)})

    def pad_to(self, n: int) -> tuple[RawBatch, Tensor]:
        """A new batch of n rows (zero rows appended, valid False) and weight float32[n]: 1 real, 0 padding."""
        b = self.rows
        if n < b:
            raise ValueError(f"RawBatch.pad_to: cannot pad {b} rows down to {n}")
        pad = n - b

        def grow(t: Tensor) -> Tensor:
            return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t.clone()

        weight = torch.cat([torch.ones(b, dtype=torch.float32), torch.zeros(pad, dtype=torch.float32)])
        padded = RawBatch(grow(self.label), grow(self.dense), grow(self.dense_valid), grow(self.sparse),
                          grow(self.sparse_valid), jagged=self.jagged.pad_rows(n))
        return padded, weight


def _column(rb: pa.RecordBatch | pa.Table, name: str) -> pa.Array:
    col = rb.column(name)
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _values(col: pa.Array, name: str) -> np.ndarray:
    if not pa.types.is_integer(col.type):
        raise TypeError(f"RawBatch.from_arrow: column {name!r} must be an integer type, got {col.type}")
    if pa.types.is_uint64(col.type) and len(col) - col.null_count:
        top = pc.max(col).as_py()
        if top > INT64_MAX:
            raise ValueError(f"RawBatch.from_arrow: column {name!r} holds ids outside the int64 range (max {top})")
    filled = pc.fill_null(col, 0) if col.null_count else col
    return filled.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _matrix(rb: pa.RecordBatch | pa.Table, names: list[str], lists: set[str]) -> tuple[Tensor, Tensor]:
    rows = rb.num_rows
    if not names:
        return torch.zeros((rows, 0), dtype=torch.int64), torch.zeros((rows, 0), dtype=torch.bool)
    # Row-major and contiguous, as the contract says: code compiled on RawBatch tensors (AOTInductor) assumes the
    # strides it saw. The fused kernels take either layout.
    values = np.zeros((rows, len(names)), dtype=np.int64)
    valid = np.zeros((rows, len(names)), dtype=bool)
    for j, n in enumerate(names):
        if n in lists:
            continue  # in RawBatch.jagged; this slot stays 0 / invalid
        col = _column(rb, n)
        values[:, j] = _values(col, n)
        valid[:, j] = col.is_valid().to_numpy(zero_copy_only=False)
    return torch.from_numpy(values), torch.from_numpy(valid)


def _float_matrix(rb: pa.RecordBatch | pa.Table, names: list[str], floats: set[str]) -> tuple[Tensor, Tensor]:
    """The dense matrix of a dataset with float columns: float64 [B, F], row-major; NaN -> missing."""
    values = np.zeros((rb.num_rows, len(names)), dtype=np.float64)
    valid = np.zeros((rb.num_rows, len(names)), dtype=bool)
    for j, n in enumerate(names):
        col = _column(rb, n)
        ok = col.is_valid().to_numpy(zero_copy_only=False)
        if n in floats:
            if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
                raise TypeError(f"RawBatch.from_arrow: float column {n!r} must be a numeric type, got {col.type}")
            x = col.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
            nan = np.isnan(x)
            if nan.any():
                ok = ok & ~nan
                x = np.where(nan, 0.0, x)
        else:
            x = _values(col, n).astype(np.float64)
        values[:, j], valid[:, j] = x, ok
    return torch.from_numpy(values), torch.from_numpy(valid)


def _jagged(col: pa.Array, name: str) -> JaggedColumn:
    """A list<int> column -> values / lengths / element validity; a null list becomes an empty list."""
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = col.flatten()  # skips the contents of null lists
    values = _values(flat, name) if len(flat) else np.zeros(0, dtype=np.int64)
    valid = flat.is_valid().to_numpy(zero_copy_only=False) if len(flat) else np.zeros(0, dtype=bool)
    if int(lengths.sum()) != len(values):
        raise ValueError(f"RawBatch.from_arrow: list column {name!r}: lengths and values disagree")
    return JaggedColumn(torch.from_numpy(np.array(values)), torch.from_numpy(np.array(lengths)),
                        torch.from_numpy(np.array(valid)))
