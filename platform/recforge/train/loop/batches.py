"""A rank's batches for one epoch: lease data-shard tasks, read their rows, cut, pad, preprocess."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import DatasetConfig
from recforge.data.schema import empty_batch
from recforge.data.shards import read_rows
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import Executor

log = logging.getLogger(__name__)


class LeasedTask(Protocol):
    """A data-shard task as the master leases it (recforge.elastic.master.tasks.Task): rows
    [row_start, row_end) of shard `shard` in epoch `epoch`."""

    @property
    def task_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def shard(self) -> int: ...
    @property
    def row_start(self) -> int: ...
    @property
    def row_end(self) -> int: ...


class TaskClient(Protocol):
    """The part of recforge.elastic.agent.client.MasterClient the trainer uses."""

    def lease(self) -> LeasedTask | None: ...
    def done(self, task_id: str, samples: int) -> bool: ...


@dataclass
class Batch:
    dense: torch.Tensor  # float32[B, Fd]
    sparse: KeyedJaggedTensor
    labels: torch.Tensor  # float32[B]
    weights: torch.Tensor  # float32[B]: 1 real row, 0 padding
    real: int  # number of real rows
    task_id: str | None = None
    last_of_task: bool = False
    epoch: int = -1  # where the real rows come from: rows [row_start, row_end) of `shard` in `epoch`
    shard: int = -1
    row_start: int = 0
    row_end: int = 0
    task_rows: int = 0  # real rows of the whole task (reported with done)


def slice_raw(raw: RawBatch, start: int, end: int) -> RawBatch:
    return type(raw)(**{f.name: getattr(raw, f.name)[start:end] for f in dataclasses.fields(raw)})


def padded_to(raw: RawBatch, batch_size: int) -> tuple[RawBatch, torch.Tensor]:
    """`raw` padded to batch_size with zero-weight rows, and the weights (1 real, 0 padding); a full batch is
    returned as it is, not copied (its readers only read it)."""
    if raw.rows == batch_size:
        return raw, torch.ones(batch_size, dtype=torch.float32)
    return raw.pad_to(batch_size)


def prepare(raw: RawBatch, batch_size: int, executor: Executor, device: torch.device) -> Batch:
    """Pad `raw` to batch_size with zero-weight rows and preprocess it. The KJT's per-key lengths and offsets are
    computed here (`sync`), where the batch is built (on the prefetch thread), not in the model's input
    all-to-all on the step's path."""
    padded, weights = padded_to(raw, batch_size)
    dense, kjt = executor(padded.to(device))
    return Batch(dense=dense, sparse=kjt.sync(), labels=padded.label.to(device), weights=weights.to(device),
                 real=raw.rows)


def empty(dataset: DatasetConfig, batch_size: int, executor: Executor, device: torch.device) -> Batch:
    """A fully zero-weight batch: what a rank without data trains so the collectives stay matched."""
    return prepare(RawBatch.from_arrow(empty_batch(dataset), dataset), batch_size, executor, device)


class TaskBatches:
    """Iterates this rank's batches of the current epoch; None once the master has no task left for it.

    The caller trains each batch, then calls `trained(batch)`: after a task's last batch that reports
    the task done (with its real row count) to the master, so a task is never marked done before its
    rows have been trained on. `ledger` (recforge.train.loop.ledger.Ledger) records every trained batch's rows.
    """

    def __init__(
        self, client: TaskClient, manifest_dir: str | Path, dataset: DatasetConfig, executor: Executor,
        batch_size: int, device: torch.device, ledger=None,
    ) -> None:
        self.client, self.manifest_dir, self.dataset = client, Path(manifest_dir), dataset
        self.executor, self.batch_size, self.device = executor, batch_size, device
        self._raw: RawBatch | None = None
        self._task: LeasedTask | None = None
        self._offset = 0
        self._exhausted = False
        self.tasks_done = 0
        self.ledger = ledger

    def next(self) -> Batch | None:
        if not self.hold_task():
            return None
        _, raw = self.held()
        start, end = self._offset, min(self._offset + self.batch_size, raw.rows)
        self._offset = end
        return self.stamp(self.prepare(slice_raw(raw, start, end)), start, end, last=end >= raw.rows)

    def held(self) -> tuple[LeasedTask, RawBatch]:
        """The task this rank holds and its rows (after `hold_task()` returned True)."""
        if self._task is None or self._raw is None:
            raise RuntimeError("TaskBatches: no task held (hold_task() first)")
        return self._task, self._raw

    def stamp(self, batch: Batch, start: int, end: int, last: bool) -> Batch:
        """Mark `batch` as rows [start, end) of the current task (`last`: its last batch)."""
        task, raw = self.held()
        batch.task_id = task.task_id
        batch.last_of_task = last
        batch.epoch, batch.shard = task.epoch, task.shard
        batch.row_start, batch.row_end = task.row_start + start, task.row_start + end
        batch.task_rows = raw.rows
        return batch

    def prepare(self, raw: RawBatch) -> Batch:
        """One batch's rows -> a trainable Batch (the RAP co-run source overrides it to defer preprocessing)."""
        return prepare(raw, self.batch_size, self.executor, self.device)

    def hold_task(self) -> bool:
        """Hold a task with rows left (leasing as needed); False once the master has none for this rank."""
        while self._raw is None or self._offset >= self._raw.rows:
            if self._exhausted or not self._lease():
                self._exhausted = True
                return False
        return True

    def reports(self, task_id: str) -> bool:
        """Whether this rank reports the task to the master: the rank that leased it (here always this one)."""
        return True

    def progress(self) -> dict[str, int]:
        """{task id: rows of it handed out as batches} for the task this rank holds; after `trained` was
        called for every batch handed out, that is how much of it the model has seen."""
        if self._task is None or self._raw is None or not self.reports(self._task.task_id):
            return {}
        return {self._task.task_id: self._offset}

    def trained(self, batch: Batch) -> None:
        if self.ledger is not None and batch.task_id is not None and batch.row_end > batch.row_start:
            self.ledger.record(batch.epoch, batch.shard, batch.row_start, batch.row_end)
        if batch.last_of_task and batch.task_id is not None:
            if self.reports(batch.task_id):
                self.client.done(batch.task_id, samples=batch.task_rows)
                self.tasks_done += 1
            if self._task is not None and self._task.task_id == batch.task_id:
                self._raw, self._task = None, None  # else (micro-batches) the next task is already leased

    def read_task(self, task: LeasedTask) -> RawBatch:
        """A task's rows (the offline-preprocessed source overrides it to read preprocessed rows)."""
        rb: pa.RecordBatch = read_rows(self.manifest_dir, task.shard, task.row_start, task.row_end)
        if rb.num_rows != task.row_end - task.row_start:
            raise RuntimeError(
                f"task {task.task_id}: read {rb.num_rows} rows, expected {task.row_end - task.row_start}")
        return RawBatch.from_arrow(rb, self.dataset)

    def lease_task(self) -> LeasedTask | None:
        """The next task for this rank from the master, or None (the mapped source leases in turns)."""
        return self.client.lease()

    def _lease(self) -> bool:
        task = self.lease_task()
        if task is None:
            return False
        self._task, self._raw, self._offset = task, self.read_task(task), 0
        if self._raw.rows == 0:  # an empty task: nothing to train, done at once
            if self.reports(task.task_id):
                self.client.done(task.task_id, samples=0)
            self._raw = None
        return True
