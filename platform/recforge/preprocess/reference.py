"""The slow, obvious oracle: numpy, one op on one feature (a 1-D column, or [B, w] for firstx) at a time.

Tests compare `ops`, `PreprocessModule` and executors against this. `sigrid_hash_ref` works on Python ints
(see recforge_kernels.reference for the folly / TorchArrow definitions and where they were checked).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from recforge.config import DatasetConfig
from recforge.preprocess.plan import FeaturePlan, Plan
from recforge_kernels.reference import sigrid_hash_ref

__all__ = [
    "fill_null_ref", "logit_ref", "boxcox_ref", "bucketize_ref", "clamp_ref", "firstx_ref", "sigrid_hash_ref",
    "sigrid_hash_np", "apply_op_ref", "apply_feature_ref", "apply_plan_ref",
]


def fill_null_ref(x: np.ndarray, valid: np.ndarray, value: float = 0, kind: str = "dense") -> np.ndarray:
    dtype = np.float32 if kind == "dense" else np.int64
    out = x.astype(dtype)
    out[~valid] = value
    return out


def logit_ref(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    x = x.astype(np.float32)
    t = np.minimum(np.maximum(x, np.float32(eps)), np.float32(1.0 - eps))  # NaN propagates
    return np.log(t / (np.float32(1.0) - t))


def boxcox_ref(x: np.ndarray, lmbda: float) -> np.ndarray:
    out = x.astype(np.float32).copy()
    for i, v in enumerate(out):
        if v > 0:
            out[i] = np.log(v) if lmbda == 0 else (np.power(v, np.float32(lmbda)) - np.float32(1)) / np.float32(lmbda)
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


def apply_op_ref(op: str, params: dict[str, Any], x: np.ndarray, valid: np.ndarray, source_kind: str) -> np.ndarray:
    if op == "fill_null":
        return fill_null_ref(x, valid, params["value"], source_kind)
    if op == "logit":
        return logit_ref(x, params["eps"])
    if op == "boxcox":
        return boxcox_ref(x, params["lambda"])
    if op == "bucketize":
        return bucketize_ref(x, params["borders"])
    if op == "clamp":
        return clamp_ref(x, params["lo"], params["hi"])
    if op == "firstx":
        return firstx_ref(x, params["X"])
    if op == "sigrid_hash":
        return sigrid_hash_np(x, params["salt"], params["M"])
    raise ValueError(f"apply_op_ref: unknown op {op!r}")


def apply_feature_ref(feature: FeaturePlan, x: np.ndarray, valid: np.ndarray, source_kind: str) -> np.ndarray:
    for spec in feature.ops:
        x = apply_op_ref(spec.op, spec.params, x, valid, source_kind)
    return x


def apply_plan_ref(
    plan: Plan,
    dataset: DatasetConfig,
    dense: np.ndarray,
    dense_valid: np.ndarray,
    sparse: np.ndarray,
    sparse_valid: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Raw columns in dataset order -> (dense float32[B, Fd], ids int64[B, Fs]) in plan order, feature by feature."""
    cols = {n: (dense[:, j], dense_valid[:, j], "dense") for j, n in enumerate(dataset.dense_names)}
    cols |= {n: (sparse[:, j], sparse_valid[:, j], "sparse") for j, n in enumerate(dataset.sparse_names)}
    rows = dense.shape[0]
    outs = {"dense": [], "sparse": []}
    for f in plan.features:
        outs[f.kind].append(apply_feature_ref(f, *cols[f.source]))
    d = np.stack(outs["dense"], axis=1) if outs["dense"] else np.zeros((rows, 0), np.float32)
    s = np.stack(outs["sparse"], axis=1) if outs["sparse"] else np.zeros((rows, 0), np.int64)
    return d.astype(np.float32), s.astype(np.int64)
