"""Stage profiler (RAP §3.3b): how long each training stage takes and how much preprocessing it can hide.

Durations are medians over real steps (StageTracker); a stage's spare capacity is the largest proxy fused kernel
(RAP's fused ngram) that runs alongside it without slowing it by more than `threshold`. Profiles are keyed by job
(`StageProfile.check` refuses another job's), stored as JSON and logged to MLflow.
Design: docs/rap.md#the-stage-profiler; not yet run on a GPU: docs/known_limits.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from recforge.config import ModelConfig
from recforge.rap.profiling.stages import STAGES, StageTracker
from recforge_kernels import fused

PROXY_FEATURES_PER_UNIT = 4
PROXY_WIDTH = 8
PROXY_N = 4  # ngram(4) over 8 values: 5 windows of 4 = 20 values a row, RAP's proxy


class ProfileMismatch(ValueError):
    """A stage profile made for another model / world size / batch size / device."""


@dataclass(frozen=True)
class ProfileKey:
    model: str  # digest of the model config and the tables
    world_size: int
    batch_size: int
    device: str

    @classmethod
    def of(cls, model_cfg: ModelConfig, tables: Sequence[tuple[str, int]], world_size: int, batch_size: int,
           device: str | torch.device) -> ProfileKey:
        cfg = model_cfg.model_dump(mode="json")
        blob = json.dumps({"model": cfg, "tables": [list(t) for t in tables]}, sort_keys=True)
        return cls(hashlib.sha256(blob.encode()).hexdigest()[:16], int(world_size), int(batch_size),
                   torch.device(device).type)

    def slug(self) -> str:
        return f"{self.model}_w{self.world_size}_b{self.batch_size}_{self.device}"


@dataclass
class StageProfile:
    key: ProfileKey
    stage_ms: dict[str, float]
    capacity_units: dict[str, int]
    capacity_ms: dict[str, float]
    unit_ms: float  # standalone time of one proxy unit
    threshold: float
    meta: dict[str, Any] = field(default_factory=dict)

    def check(self, key: ProfileKey) -> None:
        """ProfileMismatch naming every field that differs from the job's key."""
        diffs = [f"{name} {getattr(self.key, name)!r} (the job has {getattr(key, name)!r})"
                 for name in ("model", "world_size", "batch_size", "device")
                 if getattr(self.key, name) != getattr(key, name)]
        if diffs:
            what = "model config / tables" if diffs[0].startswith("model") else "job"
            raise ProfileMismatch(f"stage profile does not match the {what}: it was made for " + "; ".join(diffs))

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "key": asdict(self.key)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> StageProfile:
        data = json.loads(text)
        missing = [s for s in STAGES if s not in data.get("stage_ms", {}) or s not in data.get("capacity_ms", {})]
        if missing:
            raise ProfileMismatch(f"stage profile lacks stages {missing}")
        return cls(**{**data, "key": ProfileKey(**data["key"])})

    def save(self, root: str | Path) -> Path:
        path = Path(root) / f"{self.key.slug()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, root: str | Path, key: ProfileKey) -> StageProfile:
        path = Path(root) / f"{key.slug()}.json"
        if not path.exists():
            have = sorted(p.stem for p in Path(root).glob("*.json")) if Path(root).exists() else []
            raise ProfileMismatch(f"no stage profile for {key} under {root} (profiles there: {have})")
        profile = cls.from_json(path.read_text())
        profile.check(key)
        return profile


def log_profile(profile: StageProfile, store, run_id: str) -> None:
    """Into an MLflow run via recforge.tracking.TrackingStore: the JSON and per-stage metrics."""
    store.log_dict(run_id, json.loads(profile.to_json()), "rap/stage_profile.json")
    metrics = {f"rap_stage_ms.{s}": profile.stage_ms[s] for s in STAGES}
    metrics |= {f"rap_capacity_ms.{s}": profile.capacity_ms[s] for s in STAGES}
    metrics |= {f"rap_capacity_units.{s}": profile.capacity_units[s] for s in STAGES}
    store.log_metrics(run_id, metrics)


# ------------------------------------------------------------------ the proxy and where it runs


class ProxyKernel:
    """`units` x 4 features of [rows, 8] values through one recforge::fused_ngram launch."""

    def __init__(self, rows: int, device: str | torch.device = "cpu", max_units: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self._xs = [torch.rand(rows, PROXY_WIDTH, generator=g).to(device)
                    for _ in range(max_units * PROXY_FEATURES_PER_UNIT)]
        self._op = fused.fused_ngram
        self.max_units = max_units

    def __call__(self, units: int) -> None:
        if units > self.max_units:
            raise ValueError(f"proxy: {units} units, built for at most {self.max_units}")
        if units > 0:
            k = units * PROXY_FEATURES_PER_UNIT
            self._op(self._xs[:k], [PROXY_N] * k)

    def standalone_ms(self, units: int, repeats: int = 5) -> float:
        if units == 0:
            return 0.0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self(units)
            _sync(self._xs[0])
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class BackgroundRunner:
    """One worker thread with its own torch thread budget; on CUDA each job runs on a low-priority stream."""

    def __init__(self, threads: int = 1, cuda_device: torch.device | None = None):
        self.threads = threads
        self._stream = torch.cuda.Stream(device=cuda_device, priority=0) if cuda_device is not None else None
        self._pool = ThreadPoolExecutor(max_workers=1, initializer=torch.set_num_threads, initargs=(threads,))

    def submit(self, fn: Callable[[], None]) -> Future:
        if self._stream is None:
            return self._pool.submit(fn)
        stream = self._stream

        def on_stream():
            with torch.cuda.stream(stream):
                fn()
            stream.synchronize()

        return self._pool.submit(on_stream)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# ------------------------------------------------------------------ the search


def find_capacity(slowdown: Callable[[int], float], threshold: float, max_units: int) -> int:
    """Largest k in [0, max_units] with slowdown(k) <= threshold, assuming slowdown grows with k: double from 1
    until it exceeds the threshold, then bisect between the last size within it and the first beyond."""
    good, k = 0, 1
    while k <= max_units and slowdown(k) <= threshold:
        good, k = k, k * 2
    if k <= max_units:
        bad = k
    elif good == max_units or slowdown(max_units) <= threshold:
        return max_units
    else:
        bad = max_units
    while bad - good > 1:
        mid = (good + bad) // 2
        if slowdown(mid) <= threshold:
            good = mid
        else:
            bad = mid
    return good


class StageProfiler:
    """Drives `step()` (one full training step of the caller's loop, ending with tracker.step_end()) and owns the
    tracker's on_enter / on_exit while profiling."""

    def __init__(self, tracker: StageTracker, step: Callable[[], None], proxy: ProxyKernel,
                 runner: BackgroundRunner, steps_per_point: int = 5, warmup: int = 2, paired: bool = False):
        """paired: each size's slowdown against steps without the proxy interleaved with its own (steps_per_point
        of each), not against the one baseline measured first: on a machine whose load drifts (shared CPUs) the
        baseline of the moment is the fair one."""
        self.tracker, self.step, self.proxy, self.runner = tracker, step, proxy, runner
        self.steps_per_point, self.warmup, self.paired = steps_per_point, warmup, paired
        self._target: tuple[str, int] | None = None
        self._future: Future | None = None
        tracker.on_enter, tracker.on_exit = self._on_enter, self._on_exit

    def set_target(self, target: tuple[str, int] | None) -> None:
        """The proxy of the next steps: (stage, units), or None for steps without it (a follower rank's
        profiler mirrors its leader's, recforge.rap.profiling.profile_job)."""
        self._target = target

    @property
    def target(self) -> tuple[str, int] | None:
        return self._target

    def _on_enter(self, stage: str) -> None:
        if self._target is not None and self._target[0] == stage:
            units = self._target[1]
            self._future = self.runner.submit(lambda: self.proxy(units))

    def _on_exit(self, stage: str) -> None:
        if self._future is not None and self._target is not None and self._target[0] == stage:
            self._future.result()
            self._future = None

    def stage_medians(self, target: tuple[str, int] | None = None) -> dict[str, float]:
        self._target = target
        first = len(self.tracker.steps)
        for _ in range(self.steps_per_point):
            self.step()
        self._target = None
        steps = self.tracker.steps[first:]
        return {s: statistics.median(t.ms[s] for t in steps) for s in STAGES}

    def paired_slowdown(self, stage: str, units: int) -> float:
        """median stage time with the proxy / median without - 1, over alternating steps."""
        with_proxy: list[float] = []
        without: list[float] = []
        for i in range(2 * self.steps_per_point):
            self._target = (stage, units) if i % 2 else None
            self.step()
            (with_proxy if i % 2 else without).append(self.tracker.steps[-1].ms[stage])
        self._target = None
        return statistics.median(with_proxy) / max(statistics.median(without), 1e-9) - 1.0

    def run(self, key: ProfileKey, threshold: float = 0.02, max_units: int = 64,
            stages: Sequence[str] = STAGES) -> StageProfile:
        for _ in range(self.warmup):
            self.step()
        base = self.stage_medians()
        searched: dict[str, dict[int, float]] = {}
        units: dict[str, int] = {}
        for s in STAGES:
            if s not in stages:
                units[s] = 0
                continue
            seen: dict[int, float] = {}

            def slowdown(k: int, s: str = s, seen: dict = seen) -> float:
                if k not in seen:
                    seen[k] = (self.paired_slowdown(s, k) if self.paired
                               else self.stage_medians((s, k))[s] / max(base[s], 1e-9) - 1.0)
                return seen[k]

            units[s] = find_capacity(slowdown, threshold, max_units)
            searched[s] = seen
        unit_ms = self.proxy.standalone_ms(1)
        cap_ms = {s: self.proxy.standalone_ms(u) for s, u in units.items()}
        return StageProfile(key=key, stage_ms=base, capacity_units=units, capacity_ms=cap_ms, unit_ms=unit_ms,
                            threshold=threshold,
                            meta={"slowdown_by_units": {s: {str(k): v for k, v in d.items()}
                                                        for s, d in searched.items()},
                                  "threads": self.runner.threads, "steps_per_point": self.steps_per_point,
                                  "paired": self.paired})


def capacity_ms_from_units(units: Mapping[str, int], unit_cost: Callable[[int], float]) -> dict[str, float]:
    """Published capacities in proxy units -> ms with a proxy cost (RAP: its ngram predictor at 4 x units)."""
    return {s: float(unit_cost(u)) if u > 0 else 0.0 for s, u in units.items()}
