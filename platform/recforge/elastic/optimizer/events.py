"""Decisions of the resource optimizer as events: what it saw, what it predicted, what it chose and why.

Every stage returns events, also when it changes nothing (a "hold" with the reason), so a run's MLflow
record explains each plan. `executed` stays False until an executor (the elastic runtime) applies it:
until then events are recommendations.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STAGES = ("warm_start", "runtime", "instability")


def _clean(v: Any) -> Any:
    """JSON-safe: non-finite floats become strings, dataclasses and objects with to_dict become dicts."""
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "to_dict"):
        return _clean(v.to_dict())
    if hasattr(v, "__dataclass_fields__"):
        return _clean(asdict(v))
    return v


@dataclass
class Event:
    stage: str
    action: str            # e.g. "initial_plan", "add_worker", "relaunch_more_memory", "hold", "fallback"
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)
    prediction: dict[str, Any] = field(default_factory=dict)
    plan_before: dict[str, Any] | None = None
    plan_after: dict[str, Any] | None = None
    time_s: float = field(default_factory=time.time)
    executed: bool = False

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"Event.stage must be one of {STAGES}, got {self.stage!r}")
        if not self.reason:
            raise ValueError("Event.reason must say why")

    @property
    def changes_plan(self) -> bool:
        return self.plan_after is not None and self.plan_after != self.plan_before

    def to_dict(self) -> dict[str, Any]:
        return _clean(asdict(self))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def to_jsonl(events: Iterable[Event]) -> str:
    return "".join(json.dumps(e.to_dict(), sort_keys=True) + "\n" for e in events)


def write_jsonl(events: Iterable[Event], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_jsonl(events))
    tmp.replace(path)
    return path


def read_jsonl(path: str | Path) -> list[Event]:
    return [Event.from_dict(json.loads(line)) for line in Path(path).read_text().splitlines() if line.strip()]
