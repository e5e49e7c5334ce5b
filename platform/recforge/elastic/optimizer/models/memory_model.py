"""Per-worker memory: base + embedding shard bytes + growth per step, fitted on measured peaks.

    mem(step) = base_bytes + emb_factor * embedding_shard_bytes + growth_per_step * step

`emb_factor` >= 1 covers optimizer state next to the weights. `MemoryModel.fit` solves the non-negative
least squares problem on measured peaks (the workers' peak RSS); `fit_or_prior` keeps a prior, with the
reason, when the points cannot determine a model, and scores a fit by leave-one-run-out error;
`MemoryTrend` extrapolates one running worker's RSS to its limit (stage 3). Design: docs/dlrover_rm.md.
"""
from __future__ import annotations

import functools
import heapq
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from recforge.elastic.optimizer.models.throughput_model import DEFAULT_PROFILE, PROFILE_DIR, ModelFitError, solve_nnls

GiB = 1 << 30


MIN_POINTS = 1  # one peak calibrates the base; the other coefficients need points that vary them


@dataclass(frozen=True)
class MemorySample:
    embedding_bytes: float  # the embedding shard this worker holds
    step: int               # training steps this process ran when the memory was read
    rss_bytes: float        # its (peak) resident memory
    run: str = ""           # the job (run) that measured it: leave-one-run-out groups by this

    def to_dict(self) -> dict[str, Any]:
        return {"embedding_bytes": self.embedding_bytes, "step": self.step, "rss_bytes": self.rss_bytes,
                "run": self.run}


@dataclass
class MemoryModel:
    base_bytes: float
    emb_factor: float
    growth_per_step: float
    fit_mape: float = float("nan")
    n_points: int = 0
    source: str = ""                   # where the coefficients come from (fitted on what, or which prior and why)
    loo_mape: float = float("nan")     # leave-one-run-out relative error of the peak (NaN: fewer than 2 runs)
    n_runs: int = 0

    def __post_init__(self) -> None:
        for name in ("base_bytes", "emb_factor", "growth_per_step"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ModelFitError(f"MemoryModel.{name} must be finite and >= 0, got {v}")

    @property
    def fitted(self) -> bool:
        """Fitted on measured points (not a prior kept for lack of them)."""
        return self.source.startswith("fitted")

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
    def fit(cls, samples: Sequence[MemorySample], prior: MemoryModel | None = None,
            min_emb_factor: float = 1.0) -> MemoryModel:
        """NNLS on relative residuals, emb_factor >= `min_emb_factor` (the weights themselves are resident).
        The base is always fitted; a coefficient the points cannot determine (shard sizes spread by < 2% of
        the peaks, one step count, or no point left for it) is taken from `prior` (without one:
        emb_factor = `min_emb_factor`, growth 0) and `source` names it."""
        samples = list(samples)
        check_samples(samples)
        if len(samples) < MIN_POINTS:
            raise ModelFitError(f"MemoryModel.fit: {len(samples)} points; need at least {MIN_POINTS} measured peak")
        emb = np.array([s.embedding_bytes for s in samples], float)
        step = np.array([s.step for s in samples], float)
        y = np.array([s.rss_bytes for s in samples], float)
        # shard sizes that differ by less than 2% of the peaks cannot be told from measurement noise
        emb_free = bool(np.ptp(emb) >= 0.02 * np.median(y)) and len(y) >= 2
        step_free = bool(np.ptp(step) > 0) and len(y) >= 2 + emb_free
        emb_fixed = max(min_emb_factor, prior.emb_factor if prior is not None else min_emb_factor)
        growth_fixed = prior.growth_per_step if prior is not None else 0.0
        # the lower bound of emb_factor and the fixed coefficients move to the left-hand side
        target = y - (min_emb_factor if emb_free else emb_fixed) * emb - (0.0 if step_free else growth_fixed) * step
        cols = [np.ones_like(y)] + ([emb] if emb_free else []) + ([step] if step_free else [])
        X = np.stack(cols, axis=1)
        scale = np.maximum(np.abs(X).max(axis=0), 1e-12)  # conditioning: bytes and steps differ by 10^9
        x = solve_nnls(X / scale / y[:, None], target / y, "MemoryModel.fit")  # relative residuals
        c = list(x / scale)
        base = float(c.pop(0))
        factor = float(min_emb_factor + c.pop(0)) if emb_free else float(emb_fixed)
        growth = float(c.pop(0)) if step_free else float(growth_fixed)
        runs = {s.run for s in samples}
        fixed = [n for n, free in (("emb_factor", emb_free), ("growth_per_step", step_free)) if not free]
        m = cls(base, factor, growth, n_points=len(samples), n_runs=len(runs),
                source=f"fitted on {len(samples)} measured peaks of {len(runs)} run(s)"
                       + (f"; {', '.join(fixed)} from the prior (the points do not determine it)" if fixed else ""))
        pred = np.array([m.predict(s.embedding_bytes, s.step) for s in samples])
        m.fit_mape = float(np.mean(np.abs(pred - y) / y))
        return m

    def to_dict(self) -> dict:
        return {"base_bytes": self.base_bytes, "emb_factor": self.emb_factor, "growth_per_step": self.growth_per_step,
                "fit_mape": self.fit_mape, "n_points": self.n_points, "source": self.source,
                "loo_mape": self.loo_mape, "n_runs": self.n_runs}

    @classmethod
    def from_dict(cls, d: Mapping) -> MemoryModel:
        try:
            return cls(float(d["base_bytes"]), float(d["emb_factor"]), float(d["growth_per_step"]),
                       float(d.get("fit_mape", float("nan"))), int(d.get("n_points", 0)), str(d.get("source", "")),
                       float(d.get("loo_mape", float("nan"))), int(d.get("n_runs", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFitError(f"not a memory model: missing or bad field ({e!r})") from e


def check_samples(samples: Sequence[MemorySample]) -> None:
    """ModelFitError naming the first point and field that is not a measurement."""
    for i, s in enumerate(samples):
        for name in ("embedding_bytes", "step", "rss_bytes"):
            v = getattr(s, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ModelFitError(f"memory point {i} ({s.run or 'no run'}): {name}={v!r} must be a finite "
                                    "number >= 0")
        if not s.rss_bytes > 0:
            raise ModelFitError(f"memory point {i} ({s.run or 'no run'}): rss_bytes must be > 0")


def leave_one_run_out(samples: Sequence[MemorySample], prior: MemoryModel | None = None) -> dict[str, Any] | None:
    """Held-out error: for each run, fit on the other runs' points and predict its peaks. Returns
    {"mape", "per_run": {run: relative error}, "runs"} or None with fewer than two runs that can be held out."""
    runs = sorted({s.run for s in samples})
    per_run: dict[str, float] = {}
    errors: list[float] = []
    for r in runs:
        rest = [s for s in samples if s.run != r]
        if len(rest) < MIN_POINTS:
            continue
        m = MemoryModel.fit(rest, prior)
        held = [abs(m.predict(s.embedding_bytes, s.step) - s.rss_bytes) / s.rss_bytes for s in samples if s.run == r]
        per_run[r] = float(np.mean(held))
        errors.extend(held)
    if len(per_run) < 2:
        return None
    return {"mape": float(np.mean(errors)), "per_run": per_run, "runs": len(per_run)}


def fit_or_prior(samples: Sequence[MemorySample], prior: MemoryModel,
                 min_points: int = MIN_POINTS) -> MemoryModel:
    """The model fitted on `samples` (its leave-one-run-out error when there are 2+ runs), or `prior`
    with the reason when there are too few points or the fit fails; `source` says which."""
    samples = list(samples)
    why = None
    if len(samples) < max(min_points, MIN_POINTS):
        why = f"{len(samples)} measured point(s), need {max(min_points, MIN_POINTS)}"
    else:
        try:
            m = MemoryModel.fit(samples, prior)
            loo = leave_one_run_out(samples, prior)
            if loo is not None:
                m.loo_mape = loo["mape"]
            return m
        except ModelFitError as e:
            why = f"fit failed: {e}"
    return replace(prior, source=f"prior ({prior.source or 'unnamed'}) kept: {why}")


def samples_from_dicts(points: Sequence[Any], run: str | None = None) -> list[MemorySample]:
    """Points as logged (`MemorySample.to_dict`); malformed ones are skipped. `run` overrides their run."""
    out = []
    for p in points or ():
        try:
            s = MemorySample(float(p["embedding_bytes"]), int(p["step"]), float(p["rss_bytes"]),
                             str(run if run is not None else p.get("run", "")))
            check_samples([s])
        except (KeyError, TypeError, ValueError, ModelFitError):
            continue
        out.append(s)
    return out


def embedding_bytes_per_rank(sharding_plan: Mapping[str, Mapping[str, Any]], tables: Sequence[Sequence],
                             embedding_dim: int, world_size: int, bytes_per_value: int = 4) -> list[float]:
    """Embedding weight bytes each rank holds under the sharding planner's choice
    ({table: {sharding_type, ranks}}; tables [(name, rows)]): data_parallel copies a table to every rank,
    table_wise puts it on one, the other types split it over their ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rows = {str(name): int(n) for name, n in tables}
    missing = sorted(set(sharding_plan) - set(rows))
    if missing:
        raise ValueError(f"sharding plan names tables {missing} that the plan's tables do not have")
    per = [0.0] * world_size
    for table, p in sharding_plan.items():
        size = float(rows[table] * embedding_dim * bytes_per_value)
        ranks = [r for r in (p.get("ranks") or range(world_size)) if 0 <= int(r) < world_size] or [0]
        if p.get("sharding_type") == "data_parallel":
            for r in range(world_size):
                per[r] += size
        elif p.get("sharding_type") == "table_wise":
            per[int(ranks[0])] += size
        else:  # column_wise / row_wise / table_row_wise: split over the listed ranks
            for r in ranks:
                per[int(r)] += size / len(ranks)
    return per


DEFAULT_MEMORY_MODEL = MemoryModel(base_bytes=0.5 * GiB, emb_factor=2.0, growth_per_step=0.0,
                                   source="constant prior: 0.5 GiB + 2x the embedding shard")


def profile_memory_samples(path: str | Path = DEFAULT_PROFILE) -> list[MemorySample]:
    """The measured worker peaks of a committed trainer profile (bench/profile_trainer.py): one run per point."""
    doc = json.loads(Path(path).read_text())
    out = []
    for i, p in enumerate(doc["points"]):
        emb = p.get("embedding_bytes_per_rank") or []
        for rank, m in (p.get("memory") or {}).items():
            if rank != "-1" and int(rank) < len(emb) and m.get("peak_rss_bytes"):
                out.append(MemorySample(float(emb[int(rank)]), int(p.get("steps", 0)), float(m["peak_rss_bytes"]),
                                        f"profile-{i}"))
    return out


# The memory prior's own profile (bench/profile_trainer.py --memory): jobs trained as the daily pipeline trains
# (schema plan, flash checkpoints) at two table sizes, so that the fit separates the embedding factor from the base.
MEMORY_PROFILE = PROFILE_DIR / "dlrm_criteo_2core_memory.json"
_PROFILE_MEMORY: list[MemoryModel] = []


def local_default_memory() -> MemoryModel:
    """The cold-start memory prior of the local trainer: fitted on the measured peaks of MEMORY_PROFILE (the
    throughput profile's when it is missing); DEFAULT_MEMORY_MODEL (its source says why) when neither fits."""
    if not _PROFILE_MEMORY:
        path = MEMORY_PROFILE if MEMORY_PROFILE.exists() else DEFAULT_PROFILE
        try:
            m = fit_or_prior(profile_memory_samples(path), DEFAULT_MEMORY_MODEL)
            m.source = f"committed profile {path.name}: " + m.source
        except (OSError, ValueError, KeyError, TypeError) as e:
            m = replace(DEFAULT_MEMORY_MODEL,
                        source=f"{DEFAULT_MEMORY_MODEL.source} (profile {path.name} unusable: {e!r})")
        _PROFILE_MEMORY.append(m)
    return replace(_PROFILE_MEMORY[0])


def embedding_shard_bytes(table_bytes: Sequence[float], workers: int) -> float:
    """The largest shard when whole tables are placed largest-first on the least loaded worker
    (what table-wise sharding planners approximate)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return _shard_bytes(tuple(table_bytes), int(workers))


@functools.lru_cache(maxsize=4096)
def _shard_bytes(table_bytes: tuple[float, ...], workers: int) -> float:
    # cached: the search sizes every candidate plan's pods by it. The least loaded worker comes off a heap of
    # (load, index): the lowest load, ties to the lowest index, as min(range(workers), key=load) picks it, so the
    # same sums in the same order (`_shard_bytes_reference`), in O(tables log workers)
    tables = sorted(table_bytes, reverse=True)
    if not all(math.isfinite(b) for b in tables):
        return _shard_bytes_reference(table_bytes, workers)
    heap = [(0.0, i) for i in range(workers)]  # (a list of (0.0, i) in index order is a heap)
    for b in tables:
        load, i = heap[0]
        heapq.heapreplace(heap, (load + b, i))
    return max(load for load, _ in heap)


def _shard_bytes_reference(table_bytes: Sequence[float], workers: int) -> float:
    """`_shard_bytes` as a scan of every worker per table (its former form; the heap is tested against it)."""
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
        self._xs: list[float] = []  # the points' steps and RSS as two lists, kept in step by `add`
        self._rs: list[float] = []
        self._for: list[tuple[float, float]] | None = self.points

    def add(self, step: float, rss_bytes: float) -> None:
        in_step = self._for is self.points and len(self._xs) == len(self.points)
        self.points.append((float(step), float(rss_bytes)))
        if in_step:
            self._xs.append(float(step))
            self._rs.append(float(rss_bytes))
        if len(self.points) > self.window:
            self.points = self.points[-self.window:]
            if in_step:
                self._xs, self._rs = self._xs[-self.window:], self._rs[-self.window:]
        if in_step:
            self._for = self.points

    def copy(self) -> MemoryTrend:
        """An independent trend with the same window and points."""
        c = MemoryTrend(self.window)
        c.points = list(self.points)
        c._xs, c._rs = [p[0] for p in c.points], [p[1] for p in c.points]
        c._for = c.points
        return c

    def slope(self) -> float:
        """Least-squares bytes per step over the window (closed form: this runs on every profiler report)."""
        n = len(self.points)
        if n < 3:
            return 0.0
        # (lists, not generators, into sum: the same additions in the same order, at half the interpreter work)
        if self._for is not self.points or len(self._xs) != n:  # `points` was changed from outside
            self._xs, self._rs, self._for = [p[0] for p in self.points], [p[1] for p in self.points], self.points
        xs, rs = self._xs, self._rs
        ms = sum(xs) / n
        mr = sum(rs) / n
        dx = [x - ms for x in xs]
        den = sum([d * d for d in dx])
        if den == 0:
            return 0.0
        return sum([d * (r - mr) for d, r in zip(dx, rs, strict=True)]) / den

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
