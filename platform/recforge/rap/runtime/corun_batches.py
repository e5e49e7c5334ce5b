"""A rank's batches with RAP co-running: raw shard rows in, batch i+1 preprocessed while batch i trains.

`CorunTaskBatches` is TaskBatches reading one batch ahead; its `progress()` counts only the rows handed out to the
trainer, so a checkpoint's data state never includes the batch read ahead. Design: docs/rap.md#the-co-run-runtime;
gradient accumulation: docs/known_limits.md#rap.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.rap.runtime.corun_runtime import CorunRuntime, Pending
from recforge.train.loop.batches import Batch, TaskBatches, TaskClient, padded_to


@dataclass
class CorunBatch(Batch):
    """A batch whose preprocessing runs on the co-run thread: dense / sparse are filled when it is handed out."""

    pending: Pending | None = None
    progress_after: dict[str, int] | None = None  # the source's progress right after this batch was read

    def launched(self) -> Pending:
        """The preprocessing launched for this batch (until the batch is handed out)."""
        if self.pending is None:
            raise RuntimeError("CorunBatch: no preprocessing pending (the batch was already handed out)")
        return self.pending


if TYPE_CHECKING:
    _Source = TaskBatches  # what CorunReadAhead is mixed into: TaskBatches or a subclass of it
else:
    _Source = object


class CorunReadAhead(_Source):
    """The co-run behaviour over a batch source (mixed in before it): reads one batch ahead, completes its
    preprocessing when handing it out, closes the step's stages. The source's `next()` returns CorunBatch with
    `pending` set (its prepare step launches the kernels); `complete(batch)` fills dense / sparse."""

    def _init_corun(self, runtime: CorunRuntime, step_boundary: Callable[[], None] | None,
                    step_done: Callable[[], None] | None) -> None:
        self.runtime = runtime
        self.step_boundary = step_boundary
        self.step_done = step_done
        self._ahead: CorunBatch | None = None
        self._primed = False
        self._handed: dict[str, int] = {}

    def complete(self, batch: CorunBatch) -> None:
        batch.dense, batch.sparse = batch.launched().result()

    def next(self) -> Batch | None:
        if self.step_boundary is not None:
            self.step_boundary()
        if not self._primed:
            self._primed, self._ahead = True, self._read()
        batch = self._ahead
        if batch is None:
            return None
        self.complete(batch)
        batch.pending = None
        self._handed = dict(batch.progress_after or {})  # set by _read
        self._ahead = self._read()  # its kernels wait for the stage boundaries of the step that trains `batch`
        return batch

    def progress(self) -> dict[str, int]:
        return dict(self._handed)

    def trained(self, batch: Batch) -> None:
        if self.step_done is not None:  # the trainer reports batches after its optimizer step: the step ends here
            self.step_done()
        super().trained(batch)
        if batch.last_of_task and batch.task_id is not None:
            self._handed.pop(batch.task_id, None)

    def close(self) -> None:
        """Drop the batch read ahead (its task stays leased: the master hands it out again on expiry/restore)."""
        if self._ahead is not None and self._ahead.pending is not None:
            self._ahead.pending.results()
        self._ahead = None

    def _read(self) -> CorunBatch | None:
        batch = cast("CorunBatch | None", super().next())  # the source's prepare() gives CorunBatch
        if batch is not None:
            batch.progress_after = super().progress()
        return batch


class CorunTaskBatches(CorunReadAhead, TaskBatches):
    def __init__(
        self, client: TaskClient, manifest_dir: str | Path, dataset: DatasetConfig, runtime: CorunRuntime,
        batch_size: int, device: torch.device, ledger=None, step_boundary: Callable[[], None] | None = None,
        step_done: Callable[[], None] | None = None,
    ) -> None:
        TaskBatches.__init__(self, client, manifest_dir, dataset, runtime.executor, batch_size, device, ledger=ledger)
        self._init_corun(runtime, step_boundary, step_done)

    def prepare(self, raw: RawBatch) -> CorunBatch:
        padded, weights = padded_to(raw, self.batch_size)  # the co-run thread only reads it
        return CorunBatch(dense=None, sparse=None, labels=padded.label.to(self.device),  # type: ignore[arg-type]  # filled by complete()
                          weights=weights.to(self.device), real=raw.rows,
                          pending=self.runtime.launch(padded))  # the runtime copies it to the device


class PreprocessedBatches:
    """Every batch of `source` read and preprocessed now, before training starts (RAP's "Ideal"), then handed
    out with the same interface; `trained` passes through, so done reports stay as TaskBatches makes them."""

    def __init__(self, source: TaskBatches) -> None:
        self.inner, self.batches = source, []
        while (b := source.next()) is not None:
            self.batches.append(b)
        self.batches.reverse()

    @property
    def tasks_done(self) -> int:
        return self.inner.tasks_done

    def next(self) -> Batch | None:
        return self.batches.pop() if self.batches else None

    def trained(self, batch: Batch) -> None:
        self.inner.trained(batch)

    def progress(self) -> dict[str, int]:
        return self.inner.progress()
