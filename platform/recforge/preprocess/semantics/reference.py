"""The slow, obvious oracle: numpy, one op on one feature at a time.

Elementwise ops take a 1-D column; row ops (firstx, ngram, onehot) take a list of per-row arrays, so the same code
serves scalar columns (every row one value) and list (multi-hot) columns. `apply_feature_rows_ref` runs a whole
chain on rows; `apply_plan_ref` keeps the [B, F] interface for plans with one value per row.
`sigrid_hash_ref` works on Python ints (see recforge_kernels.reference for the folly / TorchArrow definitions).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from recforge.config import DatasetConfig
from recforge.preprocess.planning.plan import FeaturePlan, Plan
from recforge_kernels.reference import sigrid_hash_ref

__all__ = [
    "fill_null_ref", "cast_ref", "logit_ref", "log1p_ref", "boxcox_ref", "bucketize_ref", "clamp_ref", "firstx_ref",
    "sigrid_hash_ref", "sigrid_hash_np", "onehot_ref", "ngram_ref", "mapid_ref", "apply_op_ref",
    "apply_feature_ref", "apply_feature_rows_ref", "apply_plan_ref", "apply_plan_rows_ref",
]

Rows = list[np.ndarray]


def fill_null_ref(x: np.ndarray, valid: np.ndarray, value: float = 0, kind: str = "dense") -> np.ndarray:
    dtype = np.float32 if kind == "dense" else np.int64
    with np.errstate(over="ignore"):  # float64 beyond float32 rounds to +-inf, as a cast does
        out = x.astype(dtype)
    out[~valid] = value
    return out


def cast_ref(x: np.ndarray, to: str) -> np.ndarray:
    if to == "float":
        return x.astype(np.float32)
    if x.dtype == np.int64:
        return x.copy()
    out = []
    for v in x.astype(np.float32):
        if math.isnan(v):
            out.append(0)
        elif v >= 2.0**63:
            out.append(2**63 - 1)
        elif v < -(2.0**63):
            out.append(-(2**63))
        else:
            out.append(int(v))  # int() truncates toward zero
    return np.array(out, dtype=np.int64)


def logit_ref(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """Clamp in float32, the log in float64 (see ops.logit)."""
    x = x.astype(np.float32)
    t = np.minimum(np.maximum(x, np.float32(eps)), np.float32(1.0 - eps)).astype(np.float64)  # NaN propagates
    return np.log(t / (1.0 - t)).astype(np.float32)


def log1p_ref(x: np.ndarray) -> np.ndarray:
    """max(x, 0) (NaN stays NaN), log1p in float64, rounded to float32 (see ops.log1p)."""
    x64 = x.astype(np.float32).astype(np.float64)
    return np.log1p(np.where(x64 < 0, 0.0, x64)).astype(np.float32)


def boxcox_ref(x: np.ndarray, lmbda: float) -> np.ndarray:
    """Evaluated in float64 with lambda rounded to float32, the result rounded to float32 (see ops.boxcox)."""
    out = x.astype(np.float32).copy()
    lam = float(np.float32(lmbda))
    with np.errstate(over="ignore"):
        for i, v in enumerate(out):
            if v > 0:
                v64 = float(v)
                out[i] = np.float32(math.log(v64) if lam == 0 else (np.power(v64, lam) - 1.0) / lam)
    return out


def bucketize_ref(x: np.ndarray, borders: Sequence[float]) -> np.ndarray:
    b32 = [np.float32(b) for b in borders]
    return np.array([sum(1 for b in b32 if v > b) for v in x.astype(np.float32)], dtype=np.int64)


def clamp_ref(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    if x.dtype == np.int64:
        return np.array([min(max(int(v), int(lo)), int(hi)) for v in x], dtype=np.int64)
    return np.minimum(np.maximum(x, np.float32(lo)), np.float32(hi))


def firstx_ref(x: np.ndarray, X: int) -> np.ndarray:
    """[B, w] -> [B, min(X, w)]; a 1-D column is a width-1 list column and stays as it is."""
    return x if x.ndim == 1 else x[:, :X]


def sigrid_hash_np(x: np.ndarray, salt: int, M: int) -> np.ndarray:
    return np.array([sigrid_hash_ref(int(v), salt, M) for v in x], dtype=np.int64)


def mapid_ref(x: np.ndarray, table: Sequence[int]) -> np.ndarray:
    return np.array([table[int(v)] if 0 <= v < len(table) else 0 for v in x], dtype=np.int64)


def onehot_ref(row: np.ndarray, lo: float, hi: float, C: int) -> np.ndarray:
    """One row holding one value -> C float32 values (TorchArrow/RAP's computeOneHotIdx, in float32)."""
    if len(row) != 1:
        raise ValueError(f"onehot: takes one value per row, got {len(row)}")
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        step = (np.float32(hi) - np.float32(lo)) / np.float32(C)
        q = (np.float32(row[0]) - np.float32(lo)) / step
    idx = int(q) if (0 <= q < C) else 0  # NaN fails the comparison
    out = np.zeros(C, dtype=np.float32)
    out[idx] = 1.0
    return out


def ngram_ref(row: np.ndarray, n: int) -> np.ndarray:
    k = min(n, len(row))
    return np.concatenate([row[i:i + k] for i in range(len(row) - k + 1)]) if k else row[:0]


_ELEMENTWISE = {
    "cast": lambda x, p: cast_ref(x, p["to"]),
    "logit": lambda x, p: logit_ref(x, p["eps"]),
    "log1p": lambda x, p: log1p_ref(x),
    "boxcox": lambda x, p: boxcox_ref(x, p["lambda"]),
    "bucketize": lambda x, p: bucketize_ref(x, p["borders"]),
    "clamp": lambda x, p: clamp_ref(x, p["lo"], p["hi"]),
    "sigrid_hash": lambda x, p: sigrid_hash_np(x, p["salt"], p["M"]),
    "mapid": lambda x, p: mapid_ref(x, p["map"]),
}


def apply_op_ref(op: str, params: dict[str, Any], x: np.ndarray, valid: np.ndarray, source_kind: str) -> np.ndarray:
    """One op on a scalar column x[B] (or x[B, w] for firstx/ngram/onehot outputs)."""
    if op == "fill_null":
        return fill_null_ref(x, valid, params["value"], source_kind)
    if op in _ELEMENTWISE:
        return _ELEMENTWISE[op](x.reshape(-1), params).reshape(x.shape)
    rows = [r for r in (x.reshape(len(x), -1) if len(x) else np.zeros((0, 1), x.dtype))]
    out = apply_rows_op_ref(op, params, rows)
    width = len(out[0]) if out else 0
    y = np.stack(out) if out else np.zeros((0, width), dtype=x.dtype if op != "onehot" else np.float32)
    return y[:, 0] if y.ndim == 2 and y.shape[1] == 1 and x.ndim == 1 else y


def apply_rows_op_ref(op: str, params: dict[str, Any], rows: Rows) -> Rows:
    """One op (not fill_null) on a list of per-row arrays."""
    if op in _ELEMENTWISE:
        return [_ELEMENTWISE[op](r, params) for r in rows]
    if op == "firstx":
        return [r[:params["X"]] for r in rows]
    if op == "ngram":
        return [ngram_ref(r, params["n"]) for r in rows]
    if op == "onehot":
        return [onehot_ref(r, params["lo"], params["hi"], params["C"]) for r in rows]
    raise ValueError(f"apply_rows_op_ref: unknown op {op!r}")


def apply_feature_rows_ref(feature: FeaturePlan, rows: Rows, valid_rows: Sequence[np.ndarray],
                           source_kind: str) -> Rows:
    """A whole chain on per-row arrays (a scalar column: every row one value). fill_null must come first."""
    first = feature.ops[0]
    if first.op != "fill_null":
        raise ValueError(f"feature {feature.name!r}: the chain must start with fill_null")
    rows = [fill_null_ref(r, v, first.params["value"], source_kind) for r, v in zip(rows, valid_rows, strict=True)]
    for spec in feature.ops[1:]:
        rows = apply_rows_op_ref(spec.op, spec.params, rows)
    return rows


def apply_feature_ref(feature: FeaturePlan, x: np.ndarray, valid: np.ndarray, source_kind: str) -> np.ndarray:
    """A whole chain on a scalar column x[B]; the result is [B] when every row ends with one value."""
    rows = apply_feature_rows_ref(feature, [x[i:i + 1] for i in range(len(x))],
                                  [valid[i:i + 1] for i in range(len(x))], source_kind)
    dtype = np.float32 if feature.kind == "dense" else np.int64
    if not rows:
        return np.zeros(0, dtype=dtype)
    out = np.stack(rows)
    return out[:, 0] if out.shape[1] == 1 else out


def _source_rows(dataset: DatasetConfig, dense, dense_valid, sparse, sparse_valid, jagged) -> dict:
    cols = {}
    for j, n in enumerate(dataset.dense_names):
        cols[n] = ([dense[i, j:j + 1] for i in range(len(dense))], [dense_valid[i, j:j + 1] for i in range(len(dense))],
                   "dense")
    for j, n in enumerate(dataset.sparse_names):
        if jagged and n in jagged:
            cols[n] = (*jagged[n], "sparse")
        else:
            cols[n] = ([sparse[i, j:j + 1] for i in range(len(sparse))],
                       [sparse_valid[i, j:j + 1] for i in range(len(sparse))], "sparse")
    return cols


def apply_plan_rows_ref(
    plan: Plan, dataset: DatasetConfig, dense: np.ndarray, dense_valid: np.ndarray, sparse: np.ndarray,
    sparse_valid: np.ndarray, jagged: dict[str, tuple[Rows, Rows]] | None = None,
) -> dict[str, Rows]:
    """Every feature's output rows, by feature name; `jagged` gives list columns as (value rows, valid rows)."""
    cols = _source_rows(dataset, dense, dense_valid, sparse, sparse_valid, jagged)
    return {f.name: apply_feature_rows_ref(f, *cols[f.source]) for f in plan.features}


def apply_plan_ref(
    plan: Plan,
    dataset: DatasetConfig,
    dense: np.ndarray,
    dense_valid: np.ndarray,
    sparse: np.ndarray,
    sparse_valid: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Raw columns in dataset order -> (dense float32[B, Fd], ids int64[B, Fs]) in plan order, feature by feature.
    Every feature must end with one value per row."""
    out = apply_plan_rows_ref(plan, dataset, dense, dense_valid, sparse, sparse_valid)
    rows = dense.shape[0]

    def stack(kind: str, dtype) -> np.ndarray:
        names = [f.name for f in plan.features if f.kind == kind]
        if not names:
            return np.zeros((rows, 0), dtype)
        for n in names:
            if any(len(r) != 1 for r in out[n]):
                raise ValueError(f"apply_plan_ref: feature {n!r} does not give one value per row")
        return np.array([[out[n][i][0] for n in names] for i in range(rows)], dtype=dtype).reshape(rows, len(names))

    return stack("dense", np.float32), stack("sparse", np.int64)
