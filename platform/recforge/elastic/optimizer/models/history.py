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
        # (dataset, family) -> its records in insertion order, and whether their finished_at never decreased
        # (the simulator adds records as jobs finish): `similar` then reads the newest from the tail instead of
        # scanning every record (the history of a 100,000-job simulation)
        self._by_key: dict[tuple[str, str], tuple[list[JobRecord], list[bool]]] = {}
        self._indexed = 0

    def add(self, record: JobRecord) -> None:
        self.records.append(record)

    def _index(self) -> None:
        if self._indexed > len(self.records):  # records were removed from the list: index again
            self._by_key, self._indexed = {}, 0
        for r in self.records[self._indexed:]:
            lst, asc = self._by_key.setdefault((r.dataset, r.model_family), ([], [True]))
            if lst and asc[0]:
                try:
                    asc[0] = bool(r.finished_at >= lst[-1].finished_at)
                except TypeError:
                    asc[0] = False
            lst.append(r)
        self._indexed = len(self.records)

    def similar(self, dataset: str, model_family: str, limit: int = 20) -> list[JobRecord]:
        self._index()
        lst, asc = self._by_key.get((dataset, model_family), ([], [True]))
        if asc[0] and limit > 0:
            # the newest `limit`, plus every record tied with the oldest of them (the sort below is stable: ties
            # keep insertion order): the same records in the same order as sorting them all
            i = max(len(lst) - limit, 0)
            while i > 0 and lst[i - 1].finished_at == lst[i].finished_at:
                i -= 1
            same = lst[i:]
        else:
            same = list(lst)
        same.sort(key=lambda r: r.finished_at, reverse=True)
        return same[:limit]
