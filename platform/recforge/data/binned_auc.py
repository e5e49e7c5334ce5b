"""ROC AUC of a stream of scores in fixed memory (the generator's Bayes AUC and the evaluate stage score a day of any
size with it)."""
from __future__ import annotations

import numpy as np


class StreamingAuc:
    """ROC AUC over a stream of (labels, probabilities) chunks in fixed memory: positives and negatives counted per
    bin of `bins` equal-width probability bins (16 MB at 2**20), pairs within one bin counted half.

    The score differs from the exact (rank) AUC by at most `error_bound()`: half the share of (positive, negative)
    pairs that share a bin (about 1e-6 for a day's click probabilities at 2**20 bins). A day of any size is scored
    without holding its scores (docs/performance.md#the-daily-pipeline-at-scale)."""

    def __init__(self, bins: int = 2**20):
        if bins < 2:
            raise ValueError(f"StreamingAuc: bins must be >= 2, got {bins}")
        self.bins = bins
        self.pos = np.zeros(bins, dtype=np.int64)
        self.neg = np.zeros(bins, dtype=np.int64)

    def update(self, labels: np.ndarray, probs: np.ndarray) -> None:
        """Add a chunk: labels 0/1 (or bool), probabilities in [0, 1] (NaN is a ValueError)."""
        y = np.asarray(labels).reshape(-1).astype(bool)
        p = np.asarray(probs, dtype=np.float64).reshape(-1)
        if y.shape != p.shape:
            raise ValueError(f"StreamingAuc: {y.size} labels but {p.size} scores")
        if np.isnan(p).any():
            raise ValueError("StreamingAuc: a score is NaN")
        idx = np.clip((p * self.bins).astype(np.int64), 0, self.bins - 1)
        self.pos += np.bincount(idx[y], minlength=self.bins)
        self.neg += np.bincount(idx[~y], minlength=self.bins)

    @property
    def count(self) -> int:
        return int(self.pos.sum() + self.neg.sum())

    def auc(self) -> float:
        n_pos, n_neg = int(self.pos.sum()), int(self.neg.sum())
        if n_pos == 0 or n_neg == 0:
            raise ValueError("auc: needs both positive and negative labels")
        neg_below = np.cumsum(self.neg) - self.neg  # negatives in lower bins
        wins = float((self.pos * neg_below).sum()) + 0.5 * float((self.pos * self.neg).sum())
        return wins / (n_pos * n_neg)

    def error_bound(self) -> float:
        """The most auc() can differ from the exact AUC of the same scores (ties within a bin counted half)."""
        n_pos, n_neg = int(self.pos.sum()), int(self.neg.sum())
        return 0.5 * float((self.pos * self.neg).sum()) / max(1, n_pos * n_neg)
