"""History of past jobs, the input of stage 1 (warm start).

A `JobRecord` is what one finished job leaves behind: which data and model family it trained, the plan
it ended with, the throughput it measured and its fitted resource / memory models. `History` is the
seam: `InMemoryHistory` serves tests and the simulator; `resource_store.MlflowHistory` reads the
records back from MLflow runs (through recforge.tracking, the only package that talks to MLflow). A record whose model
artifact is missing or corrupt is still useful for its final plan: `model` is then None and the
problem is listed in `History.problems`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from recforge.elastic.optimizer.models.memory_model import MemoryModel
from recforge.elastic.optimizer.models.throughput_model import ThroughputModel


@dataclass
class JobRecord:
    dataset: str                     # dataset preset (or trace "scenario")
    model_family: str                # e.g. "dlrm", "dlrm_dcn"
    final_plan: dict[str, Any]       # PodPlan.to_dict() of the plan the job ended with
    samples_per_s: float | None = None
    model: ThroughputModel | None = None
    memory: MemoryModel | None = None
    peak_memory_bytes: float | None = None
    finished_at: float = 0.0
    run_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class History(Protocol):
    problems: list[str]
    # what `similar` raises when the store cannot be read (stage 1 then plans without history, a "fallback" event
    # naming the error); anything else it raises propagates
    unavailable: tuple[type[Exception], ...]

    def similar(self, dataset: str, model_family: str, limit: int = 20) -> list[JobRecord]:
        """Records of the same dataset and model family, newest first."""
        ...


class InMemoryHistory:
    def __init__(self, records: Sequence[JobRecord] = (), max_per_key: int = 50) -> None:
        self.records: list[JobRecord] = list(records)
        self.problems: list[str] = []
        self.unavailable: tuple[type[Exception], ...] = ()  # a list in memory is always readable
        self.max_per_key = max_per_key

    def add(self, record: JobRecord) -> None:
        self.records.append(record)

    def similar(self, dataset: str, model_family: str, limit: int = 20) -> list[JobRecord]:
        same = [r for r in self.records if r.dataset == dataset and r.model_family == model_family]
        same.sort(key=lambda r: r.finished_at, reverse=True)
        return same[:limit]
