"""Offline metrics of a click model: AUC, logloss, normalized entropy; evaluation over a manifest."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from recforge.data.shards import open_manifest, read_rows
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import Executor
from recforge.train.loop.batches import slice_raw


def _check(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels ({y.size}) and scores ({s.size}) differ in length")
    if y.size == 0:
        raise ValueError("no samples")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("labels must be 0 or 1")
    return y, s


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by ranks (Mann-Whitney U), ties counted half."""
    y, s = _check(labels, scores)
    n_pos = float(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("auc needs both positive and negative labels")
    from scipy.stats import rankdata  # lazy: ~0.7 s of a rank's start-up (only a tracked rank 0 calls it)

    ranks = rankdata(s, method="average")
    return float((ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logloss(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross entropy of sigmoid(logits), computed stably from the logits (natural log)."""
    y, z = _check(labels, logits)
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def base_entropy(labels: np.ndarray) -> float:
    """Logloss of always predicting the base rate p: -(p log p + (1-p) log(1-p))."""
    p = float(np.mean(labels))
    if p <= 0.0 or p >= 1.0:
        raise ValueError("normalized entropy needs both positive and negative labels")
    return -(p * np.log(p) + (1 - p) * np.log(1 - p))


def normalized_entropy(labels: np.ndarray, logits: np.ndarray) -> float:
    """logloss / entropy of the base rate (He et al. 2014): < 1 beats predicting the click rate."""
    return float(logloss(labels, logits) / base_entropy(labels))


@torch.no_grad()
def predict(model: torch.nn.Module, executor: Executor, manifest_dir: str | Path,
            batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels, logits) over every row of the manifest, in shard order."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    manifest = open_manifest(manifest_dir)
    was_training = model.training
    model.eval()
    labels, logits = [], []
    try:
        for i, shard in enumerate(manifest.shards):
            whole = RawBatch.from_arrow(read_rows(manifest_dir, i, 0, shard.rows), manifest.dataset)
            for start in range(0, shard.rows, batch_size):
                raw = slice_raw(whole, start, min(start + batch_size, shard.rows))
                dense, kjt = executor(raw)
                logits.append(model(dense, kjt).reshape(-1).float().cpu().numpy())
                labels.append(raw.label.numpy())
    finally:
        model.train(was_training)
    if not labels:
        raise ValueError(f"manifest {manifest_dir} has no rows to evaluate")
    return np.concatenate(labels), np.concatenate(logits)


class NonFiniteMetricsError(ValueError):
    """The model's outputs or metrics are NaN/inf: it must never be recorded as evaluated, nor promoted."""


def evaluate(model: torch.nn.Module, executor: Executor, manifest_dir: str | Path,
             batch_size: int = 4096) -> dict[str, float]:
    """{auc, logloss, ne, rows} of `model` (logits out) on every row of the manifest.

    Raises NonFiniteMetricsError when a logit or a metric is NaN/inf (a NaN model has no AUC)."""
    y, z = predict(model, executor, manifest_dir, batch_size)
    bad = ~np.isfinite(z)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise NonFiniteMetricsError(
            f"the model's logits are not finite on {int(bad.sum())} of {z.size} rows of {manifest_dir} (first: row "
            f"{first}, {z[first]}): its weights hold NaN/inf; no metric is recorded for it")
    out = {"auc": auc(y, z), "logloss": logloss(y, z), "ne": normalized_entropy(y, z)}
    nonfinite = {k: v for k, v in out.items() if not np.isfinite(v)}
    if nonfinite:
        raise NonFiniteMetricsError(f"metrics {nonfinite} on {manifest_dir} are not finite")
    return {**out, "rows": int(y.size)}
