"""Per-worker memory: base + embedding shard bytes + growth per step, and out-of-memory prediction.

    mem(step) = base_bytes + emb_factor * embedding_shard_bytes + growth_per_step * step

`emb_factor` >= 1 covers optimizer state next to the weights (row-wise Adagrad keeps one float per
row, plain Adagrad a full copy). Embedding tables that grow as new ids arrive (DLRover's
EmbeddingVariables) show up as growth per step; our TorchRec tables are preallocated, so on our
trainer the growth is the allocator's drift. `MemoryModel.fit` solves the non-negative least squares
problem on profiled peaks; `MemoryTrend` fits one running worker's recent RSS samples and extrapolates
when it will cross its limit, which is what stage 3 acts on before the OOM happens.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from recforge.elastic.optimizer.models.throughput_model import ModelFitError

GiB = 1 << 30


@dataclass(frozen=True)
class MemorySample:
    embedding_bytes: float  # the embedding shard this worker holds
    step: int               # training steps done when the memory was read
    rss_bytes: float


@dataclass
class MemoryModel:
    base_bytes: float
    emb_factor: float
    growth_per_step: float
    fit_mape: float = float("nan")
    n_points: int = 0

    def __post_init__(self) -> None:
        for name in ("base_bytes", "emb_factor", "growth_per_step"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ModelFitError(f"MemoryModel.{name} must be finite and >= 0, got {v}")

    def predict(self, embedding_bytes: float, step: float = 0) -> float:
        return self.base_bytes + self.emb_factor * embedding_bytes + self.growth_per_step * step

    def steps_until(self, limit_bytes: float, embedding_bytes: float, step: float = 0) -> float:
        """Steps from `step` until the prediction reaches `limit_bytes` (0 if already over, inf if never)."""
        now = self.predict(embedding_bytes, step)
        if now >= limit_bytes:
            return 0.0
        if self.growth_per_step <= 0:
            return math.inf
        return (limit_bytes - now) / self.growth_per_step

    def will_oom(self, limit_bytes: float, embedding_bytes: float, total_steps: float, margin: float = 1.0) -> bool:
        """Would the worker exceed `limit_bytes / margin` before `total_steps`?"""
        return self.predict(embedding_bytes, total_steps) * margin > limit_bytes

    def required_bytes(self, embedding_bytes: float, total_steps: float, margin: float = 1.2) -> float:
        return self.predict(embedding_bytes, total_steps) * margin

    @classmethod
    def fit(cls, samples: Sequence[MemorySample]) -> MemoryModel:
        samples = list(samples)
        if len(samples) < 3:
            raise ModelFitError(f"MemoryModel.fit: {len(samples)} points; need at least 3 (base, embeddings, growth)")
        if any(not (s.rss_bytes > 0) for s in samples):
            raise ModelFitError("MemoryModel.fit: rss_bytes must be > 0")
        X = np.array([[1.0, s.embedding_bytes, s.step] for s in samples], float)
        y = np.array([s.rss_bytes for s in samples], float)
        scale = np.maximum(np.abs(X).max(axis=0), 1e-12)  # conditioning: bytes and steps differ by 10^9
        c, _ = nnls(X / scale / y[:, None], np.ones_like(y))  # relative residuals
        c = c / scale
        m = cls(float(c[0]), float(c[1]), float(c[2]), n_points=len(samples))
        pred = np.array([m.predict(s.embedding_bytes, s.step) for s in samples])
        m.fit_mape = float(np.mean(np.abs(pred - y) / y))
        return m

    def to_dict(self) -> dict:
        return {"base_bytes": self.base_bytes, "emb_factor": self.emb_factor, "growth_per_step": self.growth_per_step,
                "fit_mape": self.fit_mape, "n_points": self.n_points}

    @classmethod
    def from_dict(cls, d: Mapping) -> MemoryModel:
        try:
            return cls(float(d["base_bytes"]), float(d["emb_factor"]), float(d["growth_per_step"]),
                       float(d.get("fit_mape", float("nan"))), int(d.get("n_points", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFitError(f"not a memory model: missing or bad field ({e!r})") from e


DEFAULT_MEMORY_MODEL = MemoryModel(base_bytes=0.5 * GiB, emb_factor=2.0, growth_per_step=0.0)


def embedding_shard_bytes(table_bytes: Sequence[float], workers: int) -> float:
    """The largest shard when whole tables are placed largest-first on the least loaded worker
    (what table-wise sharding planners approximate)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    load = [0.0] * workers
    for b in sorted(table_bytes, reverse=True):
        i = min(range(workers), key=load.__getitem__)
        load[i] += b
    return max(load)


class MemoryTrend:
    """A running worker's RSS over steps: a least-squares line over the last `window` samples."""

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self.points: list[tuple[float, float]] = []

    def add(self, step: float, rss_bytes: float) -> None:
        self.points.append((float(step), float(rss_bytes)))
        if len(self.points) > self.window:
            self.points = self.points[-self.window:]

    def slope(self) -> float:
        """Least-squares bytes per step over the window (closed form: this runs on every profiler report)."""
        n = len(self.points)
        if n < 3:
            return 0.0
        ms = sum(p[0] for p in self.points) / n
        mr = sum(p[1] for p in self.points) / n
        den = sum((p[0] - ms) ** 2 for p in self.points)
        if den == 0:
            return 0.0
        return sum((p[0] - ms) * (p[1] - mr) for p in self.points) / den

    def predicted_at(self, step: float) -> float:
        if not self.points:
            return 0.0
        last_s, last_r = self.points[-1]
        return last_r + max(self.slope(), 0.0) * (step - last_s)

    def steps_to_exhaustion(self, limit_bytes: float) -> float:
        if not self.points:
            return math.inf
        last_r = self.points[-1][1]
        if last_r >= limit_bytes:
            return 0.0
        g = self.slope()
        return math.inf if g <= 0 else (limit_bytes - last_r) / g


def next_memory(current_bytes: float, *, needed_bytes: float = 0.0, max_step_bytes: float = 8 * GiB,
                cap_bytes: float = 64 * GiB) -> float:
    """DLRover's OOM relaunch size: double, but at most +8 GiB a step, at least what is predicted to be
    needed (still within the step), never above the cap."""
    target = max(2 * current_bytes, needed_bytes)
    return float(min(target, current_bytes + max_step_bytes, cap_bytes))
