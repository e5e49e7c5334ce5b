"""Synthetic raw batches for tests and benchmarks: Criteo-like values, nulls, int64 extremes, list columns."""
from __future__ import annotations

import numpy as np
import torch

from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.jagged import JaggedColumn, JaggedColumns

INT64_MIN, INT64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max
EXTREMES = np.array([0, 1, -1, INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1, 2**31, -(2**31), 2**53 + 1])
# float dense columns: beyond float32 (-> inf), subnormal, signed zero, NaN / inf, near float32 rounding
FLOAT_EXTREMES = np.array([0.0, -0.0, 1.0, -1.0, np.nan, np.inf, -np.inf, 1e300, -1e300, 1e-45, 1e-300, 3.4028235e38,
                           2.0**53 + 1, 0.1, 1e-9, 16777217.0])


def random_raw_batch(
    dataset: DatasetConfig, rows: int, seed: int = 0, null_rate: float = 0.2, extreme_rate: float = 0.05,
    list_columns: tuple[str, ...] = (), max_list: int = 6,
) -> RawBatch:
    """Dense values mostly small (Criteo counts, some negative), sparse ids 32-bit, a share of nulls and int64
    extremes; `list_columns` (sparse names) become list columns of 0..max_list ids (some empty, some null
    elements). A dataset with a float dense column gets a float64 dense matrix, as RawBatch.from_arrow makes it:
    its float columns hold fractions and float extremes (NaN, +-inf, beyond float32), its int columns counts."""
    rng = np.random.default_rng(seed)
    fd, fs = len(dataset.dense), len(dataset.sparse)
    dense = rng.integers(-3, 60, (rows, fd))
    sparse = rng.integers(0, 2**32, (rows, fs))
    for m in (dense, sparse):
        hit = rng.random(m.shape) < extreme_rate
        m[hit] = rng.choice(EXTREMES, int(hit.sum()))
    floats = [j for j, c in enumerate(dataset.dense) if c.dtype == "float"]
    if floats:
        dense = np.clip(dense, -(2**53), 2**53).astype(np.float64)  # int columns of a float matrix: exact
        for j in floats:
            col = rng.lognormal(0.0, 3.0, rows) * rng.choice([1.0, 1.0, 1.0, -1.0], rows)
            hit = rng.random(rows) < extreme_rate
            col[hit] = rng.choice(FLOAT_EXTREMES, int(hit.sum()))
            dense[:, j] = col
    dense_valid = rng.random((rows, fd)) >= null_rate
    sparse_valid = rng.random((rows, fs)) >= null_rate
    jagged = {}
    for name in list_columns:
        j = dataset.sparse_names.index(name)
        sparse[:, j], sparse_valid[:, j] = 0, False
        lengths = rng.integers(0, max_list + 1, rows)
        n = int(lengths.sum())
        values = rng.integers(0, 2**32, n)
        hit = rng.random(n) < extreme_rate
        values[hit] = rng.choice(EXTREMES, int(hit.sum()))
        jagged[name] = JaggedColumn(torch.from_numpy(values.astype(np.int64)), torch.from_numpy(lengths),
                                    torch.from_numpy(rng.random(n) >= null_rate))
    return RawBatch(  # row-major, as RawBatch.from_arrow makes them
        label=torch.from_numpy(rng.integers(0, 2, rows).astype(np.float32)),
        dense=torch.from_numpy(dense if floats else dense.astype(np.int64)), dense_valid=torch.from_numpy(dense_valid),
        sparse=torch.from_numpy(sparse.astype(np.int64)), sparse_valid=torch.from_numpy(sparse_valid),
        jagged=JaggedColumns(jagged),
    )


def reference_inputs(raw: RawBatch) -> tuple:
    """RawBatch -> the arguments of reference.apply_plan_rows_ref (numpy, list columns as per-row arrays)."""
    jagged = {}
    for name, col in raw.jagged.items():
        off = col.offsets().tolist()
        v, ok = col.values.numpy(), col.valid.numpy()
        jagged[name] = ([v[off[i]:off[i + 1]] for i in range(col.rows)],
                        [ok[off[i]:off[i + 1]] for i in range(col.rows)])
    return raw.dense.numpy(), raw.dense_valid.numpy(), raw.sparse.numpy(), raw.sparse_valid.numpy(), jagged
