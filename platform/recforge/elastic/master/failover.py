"""Failover policy (DLRover `_should_relaunch`): relaunch a failed worker group or give up, and how.

Workers record their exception (`record_exception`) as `<failures_dir>/gen<g>-rank<r>.json`; the supervisor
turns a failed launch into a `Failure` and asks `FailoverPolicy.decide`: give up on bad input data (a DataError:
a relaunch reads the same data), a deterministic code error (the same exception at the same place twice) or a spent
restart budget, else relaunch, after out-of-memory with more gradient accumulation or more memory.
Design: docs/fault_tolerance.md#the-failover-policy.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OOM_PATTERNS = ("out of memory", "can't allocate memory", "cannot allocate memory", "std::bad_alloc")
COLLATERAL_PATTERNS = (
    "connection closed by peer", "connection reset by peer", "broken pipe", "gloo", "nccl", "timed out",
    "socket", "tcpstore", "rendezvous", "process group", "processgroup",
)


@dataclass
class FailureRecord:
    generation: int
    rank: int
    exc_type: str
    message: str
    where: str  # "file:line in function" of the innermost frame
    traceback: str
    oom: bool
    collateral: bool
    time: float
    data_error: bool = False  # a recforge.data.errors.DataError: the input data is bad, not the code

    @property
    def signature(self) -> str:
        msg = re.sub(r"\d+", "#", self.message.splitlines()[0] if self.message else "")[:200]
        return f"{self.exc_type} at {self.where}: {msg}"


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(p in text for p in OOM_PATTERNS)


def is_data_error(exc: BaseException) -> bool:
    """A recforge.data.errors.DataError (checked by class, without importing recforge.data: an instance means its
    module is loaded)."""
    cls = getattr(sys.modules.get("recforge.data.errors"), "DataError", None)
    return isinstance(cls, type) and isinstance(exc, cls)


def is_collateral(exc: BaseException) -> bool:
    """An error a rank gets because another rank (or the store) went away."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "ConnectionError"}:
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(p in text for p in COLLATERAL_PATTERNS)


def record_exception(failures_dir: str | Path, *, rank: int, generation: int, exc: BaseException) -> Path:
    tb = exc.__traceback__
    frames = traceback.extract_tb(tb) if tb is not None else []
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "unknown"
    rec = FailureRecord(
        generation=generation, rank=rank, exc_type=type(exc).__name__, message=str(exc)[:2000], where=where,
        traceback="".join(traceback.format_exception(exc))[-8000:], oom=is_oom(exc),
        collateral=is_collateral(exc) and not is_oom(exc), time=time.time(), data_error=is_data_error(exc),
    )
    d = Path(failures_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"gen{generation:04d}-rank{rank}.json"
    tmp = d / f".{path.name}.tmp"
    tmp.write_text(json.dumps(asdict(rec), indent=1))
    os.replace(tmp, path)
    return path


def read_records(failures_dir: str | Path | None, generations: range) -> list[FailureRecord]:
    if failures_dir is None or not Path(failures_dir).is_dir():
        return []
    out = []
    for p in sorted(Path(failures_dir).glob("gen*-rank*.json")):
        m = re.fullmatch(r"gen(\d+)-rank(\d+)\.json", p.name)
        if m and int(m.group(1)) in generations:
            out.append(FailureRecord(**json.loads(p.read_text())))
    return sorted(out, key=lambda r: r.time)


@dataclass
class Failure:
    kind: str  # "error" | "data" | "oom" | "killed" | "hang"
    exit_code: int | None
    generations: list[int]
    records: list[FailureRecord] = field(default_factory=list)
    detail: str = ""

    @property
    def root(self) -> FailureRecord | None:
        """The first non-collateral exception recorded, if any."""
        return next((r for r in self.records if not r.collateral), None)

    @property
    def signature(self) -> str | None:
        r = self.root
        return r.signature if r is not None and self.kind == "error" else None

    def describe(self) -> str:
        r = self.root
        gens = f"generation(s) {self.generations}" if self.generations else "no generation"
        if r is not None:
            first_line = r.message.splitlines()[0][:300]
            return f"{self.kind}: rank {r.rank} raised {r.exc_type} at {r.where}: {first_line} ({gens})"
        detail = self.detail or "a worker died without an exception"
        return f"{self.kind}: {detail} (exit code {self.exit_code}, {gens})"

    @classmethod
    def from_launch(cls, exit_code: int | None, records: list[FailureRecord], generations: list[int],
                    hang: bool = False, detail: str = "", oom_killed: bool = False) -> Failure:
        """`oom_killed`: the platform reports an out-of-memory kill (Kubernetes: reason OOMKilled)."""
        primary = [r for r in records if not r.collateral]
        if hang:
            kind = "hang"
        elif oom_killed or any(r.oom for r in primary):
            kind = "oom"
        elif primary and primary[0].data_error:
            kind = "data"
        elif primary:
            kind = "error"
        else:
            kind = "killed"
        return cls(kind=kind, exit_code=exit_code, generations=generations, records=records, detail=detail)


@dataclass
class Decision:
    relaunch: bool
    reason: str
    grad_accumulation: int | None = None  # new value (local OOM)
    memory_factor: float | None = None  # multiply the pod memory by this (Kubernetes OOM)


class FailoverPolicy:
    def __init__(self, max_relaunches: int = 3, *, hang_timeout_s: float = 1800.0, startup_timeout_s: float = 900.0,
                 oom_action: str = "accumulate", max_grad_accumulation: int = 64, memory_growth: float = 1.5) -> None:
        if max_relaunches < 0:
            raise ValueError(f"max_relaunches must be >= 0, got {max_relaunches}")
        if hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout_s must be > 0, got {hang_timeout_s}")
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.startup_timeout_s = startup_timeout_s
        if oom_action not in ("accumulate", "more_memory"):
            raise ValueError(f"oom_action must be 'accumulate' or 'more_memory', got {oom_action!r}")
        if memory_growth <= 1.0:
            raise ValueError(f"memory_growth must be > 1, got {memory_growth}")
        self.max_relaunches, self.hang_timeout_s, self.oom_action = max_relaunches, hang_timeout_s, oom_action
        self.max_grad_accumulation, self.memory_growth = max_grad_accumulation, memory_growth

    def decide(self, failure: Failure, history: list[Failure], *, restarts_used: int, batch_size: int,
               grad_accumulation: int) -> Decision:
        """`history`: earlier failures of this job; `restarts_used`: group restarts so far (all kinds)."""
        if failure.kind == "data":
            return Decision(False, f"data error, not relaunched (a relaunch reads the same data): "
                                   f"{failure.describe()}")
        sig = failure.signature
        if sig is not None:
            for old in history:
                if old.signature == sig:
                    return Decision(False, "deterministic code error, not relaunched: the same exception at the "
                                           f"same place twice (generations {old.generations} and "
                                           f"{failure.generations}): {sig}")
        if restarts_used >= self.max_relaunches:
            return Decision(False, f"restart budget exhausted: {restarts_used} restart(s) used of "
                                   f"{self.max_relaunches}; last failure: {failure.describe()}")
        if failure.kind == "oom":
            if self.oom_action == "more_memory":
                return Decision(True, f"out of memory: relaunch with {self.memory_growth}x memory",
                                memory_factor=self.memory_growth)
            k = grad_accumulation * 2
            if k > self.max_grad_accumulation or batch_size % k != 0:
                return Decision(False, f"out of memory at a per-rank batch of {batch_size // grad_accumulation}; "
                                       f"cannot halve it again (batch_size {batch_size}, "
                                       f"accumulation {grad_accumulation})")
            return Decision(True, f"out of memory: relaunch with per-rank batch {batch_size // k} x {k} accumulation "
                                  f"steps (global batch unchanged)", grad_accumulation=k)
        if failure.kind == "hang":
            return Decision(True, f"hang: {failure.detail or f'no training progress for {self.hang_timeout_s:.0f}s'}; "
                                  f"killed, relaunching")
        return Decision(True, f"relaunching: {failure.describe()}")

    def to_dict(self) -> dict[str, Any]:
        return {"max_relaunches": self.max_relaunches, "hang_timeout_s": self.hang_timeout_s,
                "startup_timeout_s": self.startup_timeout_s,
                "oom_action": self.oom_action, "max_grad_accumulation": self.max_grad_accumulation,
                "memory_growth": self.memory_growth}
