"""Dynamic data sharding (DLRover-RM section 5): the job master's task queue, pure logic, no I/O.

Every epoch the shards are cut into tasks of at most `rows_per_task` rows; a task moves TODO -> DOING (a lease)
-> DONE, at least once per row: an expired lease, or one of an older launch generation, goes back to TODO as a
retry, and the `max_retries`-th such failure quarantines the task as POISON. Time is passed in (`now`, wall-clock
seconds, so that deadlines survive persistence). `request()` decides a lease call; `Grant` lists its four answers.
Design: docs/fault_tolerance.md#data-shard-tasks.
"""
from __future__ import annotations

import bisect
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict

STATE_VERSION = 1


class Task(BaseModel):
    """One data-shard task: rows [row_start, row_end) of shard `shard`, in epoch `epoch`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task_id: str
    epoch: int
    shard: int
    row_start: int
    row_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


class TaskState(StrEnum):
    TODO = "todo"
    DOING = "doing"
    DONE = "done"
    POISON = "poison"


class Outcome(StrEnum):
    """Answer to done / release. `ok` is True for ACCEPTED and DUPLICATE (an idempotent repeat)."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # the same worker already completed this call; nothing changes
    STALE = "stale"  # the worker does not hold the lease (expired, re-leased, quarantined)
    UNKNOWN = "unknown"  # no such task in the current epoch

    @property
    def ok(self) -> bool:
        return self in (Outcome.ACCEPTED, Outcome.DUPLICATE)


class Action(StrEnum):
    TASK = "task"  # here is a task
    END_EPOCH = "end_epoch"  # nothing TODO in your epoch: end it (other tasks may still be in flight)
    WAIT = "wait"  # you are ahead: the master still waits for in-flight tasks of an older epoch; ask again
    FINISHED = "finished"  # all epochs are done


class Grant(BaseModel):
    action: Action
    task: Task | None = None
    epoch: int  # the queue's current epoch (== epochs when finished)
    epochs: int


@dataclass
class Requeued:
    """Tasks taken back from their holders: `requeued` went back to TODO, `poisoned` were quarantined."""

    requeued: list[Task] = field(default_factory=list)
    poisoned: list[Task] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requeued or self.poisoned)

    def extend(self, other: Requeued) -> None:
        self.requeued.extend(other.requeued)
        self.poisoned.extend(other.poisoned)


@dataclass
class _Record:
    task: Task
    order: int  # place in the epoch's hand-out order
    state: TaskState = TaskState.TODO
    worker_id: str | None = None  # lease holder while DOING, completer when DONE, last holder otherwise
    deadline: float | None = None
    generation: int = 0
    retries: int = 0

    def key(self) -> tuple[int, int, str]:
        return (self.order, self.task.row_start, self.task.task_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task.model_dump(),
            "order": self.order,
            "state": self.state.value,
            "worker_id": self.worker_id,
            "deadline": self.deadline,
            "generation": self.generation,
            "retries": self.retries,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> _Record:
        return cls(
            task=Task.model_validate(d["task"]),
            order=int(d["order"]),
            state=TaskState(d["state"]),
            worker_id=d["worker_id"],
            deadline=d["deadline"],
            generation=int(d["generation"]),
            retries=int(d["retries"]),
        )


def _task_id(epoch: int, shard: int, row_start: int) -> str:
    # Unique within an epoch: task ranges of one epoch never overlap, so their starts differ.
    return f"e{epoch}-s{shard}-r{row_start}"


class TaskQueue:
    """TODO / DOING / DONE data-shard tasks over `epochs` passes of the data. Not thread-safe."""

    def __init__(
        self,
        shard_rows: Sequence[int],
        rows_per_task: int,
        epochs: int = 1,
        *,
        lease_timeout_s: float = 120.0,
        max_retries: int = 3,
        shuffle_seed: int | None = None,
    ) -> None:
        shard_rows = [int(n) for n in shard_rows]
        if any(n < 0 for n in shard_rows):
            raise ValueError(f"shard_rows: row counts must be >= 0, got {shard_rows}")
        if rows_per_task < 1:
            raise ValueError(f"rows_per_task must be >= 1, got {rows_per_task}")
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        if lease_timeout_s <= 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {lease_timeout_s}")
        if max_retries < 1:
            raise ValueError(f"max_retries must be >= 1, got {max_retries}")
        self.shard_rows = shard_rows
        self.rows_per_task = int(rows_per_task)
        self.epochs = int(epochs)
        self.lease_timeout_s = float(lease_timeout_s)
        self.max_retries = int(max_retries)
        self.shuffle_seed = shuffle_seed
        self.epoch = 0
        self.generation = 0
        self._records: dict[str, _Record] = {}
        self._todo: list[tuple[int, int, str]] = []  # sorted keys of TODO records
        self._history: list[dict[str, int]] = []  # one summary per completed epoch
        self._poisoned: list[Task] = []
        self._prev_done: dict[str, tuple[str, int]] = {}  # previous epoch's DONE tasks: completer, rows
        self._start_epoch()

    def restarted(self) -> TaskQueue:
        """A queue of the same data and settings with nothing done (a job starting over)."""
        return TaskQueue(self.shard_rows, self.rows_per_task, self.epochs, lease_timeout_s=self.lease_timeout_s,
                         max_retries=self.max_retries, shuffle_seed=self.shuffle_seed)

    # ---- queries -------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.epoch >= self.epochs

    @property
    def rows_per_epoch(self) -> int:
        return sum(self.shard_rows)

    @property
    def in_flight(self) -> int:
        """DOING tasks of the current epoch."""
        return sum(1 for r in self._records.values() if r.state is TaskState.DOING)

    @property
    def todo(self) -> int:
        return len(self._todo)

    @property
    def poisoned(self) -> list[Task]:
        return list(self._poisoned)

    @property
    def history(self) -> list[dict[str, int]]:
        return [dict(h) for h in self._history]

    def tasks(self, state: TaskState | None = None) -> list[Task]:
        """Tasks of the current epoch (optionally only those in `state`), in hand-out order."""
        recs = sorted(self._records.values(), key=_Record.key)
        return [r.task for r in recs if state is None or r.state is state]

    def holder(self, task_id: str) -> str | None:
        rec = self._records.get(task_id)
        return rec.worker_id if rec is not None and rec.state is TaskState.DOING else None

    def retries(self, task_id: str) -> int:
        return self._records[task_id].retries

    def state_of(self, task_id: str) -> TaskState | None:
        rec = self._records.get(task_id)
        return rec.state if rec is not None else None

    def summary(self) -> dict[str, Any]:
        counts = {s.value: 0 for s in TaskState}
        rows_done = 0
        for r in self._records.values():
            counts[r.state.value] += 1
            if r.state is TaskState.DONE:
                rows_done += r.task.rows
        return {
            "epoch": self.epoch,
            "epochs": self.epochs,
            "finished": self.finished,
            "tasks": counts,
            "rows_per_epoch": self.rows_per_epoch,
            "rows_done_this_epoch": rows_done,
            "rows_done_total": rows_done + sum(h["rows_done"] for h in self._history),
            "history": self.history,
            "poisoned": [t.model_dump() for t in self._poisoned],
            "generation": self.generation,
        }

    # ---- transitions ---------------------------------------------------------------------
    def lease(self, worker_id: str, now: float, generation: int = 0) -> Task | None:
        """Lease the next TODO task of the current epoch, or None when the epoch has nothing TODO."""
        if not self._todo:
            return None
        _, _, task_id = self._todo.pop(0)
        rec = self._records[task_id]
        rec.state = TaskState.DOING
        rec.worker_id = worker_id
        rec.deadline = now + self.lease_timeout_s
        rec.generation = generation
        return rec.task

    def request(self, worker_id: str, now: float, epoch: int | None = None, generation: int = 0) -> Grant:
        """A worker in its epoch `epoch` (None: "whatever is current") asks for work.

        FINISHED when all epochs are done; END_EPOCH when the worker's epoch is over or has nothing
        TODO left (tasks still in flight elsewhere belong to their holders); a TASK of the current
        epoch when one is TODO, also for a worker that is already in a later epoch (leftovers that
        came back from a failed holder are handed to whoever asks); WAIT when the worker is ahead of
        the queue and nothing is TODO (the current epoch waits for in-flight tasks to finish or expire).
        """
        if self.finished:
            return self._grant(Action.FINISHED)
        if epoch is not None and epoch < self.epoch:
            return self._grant(Action.END_EPOCH)
        task = self.lease(worker_id, now, generation)
        if task is not None:
            return self._grant(Action.TASK, task)
        if epoch is not None and epoch > self.epoch:
            return self._grant(Action.WAIT)
        return self._grant(Action.END_EPOCH)

    def done(self, task_id: str, worker_id: str) -> Outcome:
        """The worker consumed the whole task. Accepted only from the current lease holder."""
        rec = self._records.get(task_id)
        if rec is None:
            return self._previous_epoch_answer(task_id, worker_id, None)
        if rec.state is TaskState.DOING and rec.worker_id == worker_id:
            rec.state = TaskState.DONE
            rec.deadline = None
            self._maybe_advance()
            return Outcome.ACCEPTED
        if rec.state is TaskState.DONE and rec.worker_id == worker_id:
            return Outcome.DUPLICATE
        return Outcome.STALE

    def release(self, task_id: str, worker_id: str, rows_consumed: int) -> Outcome:
        """The worker gives its task back after consuming its first `rows_consumed` rows.

        The consumed prefix is DONE (keeping the task id, with row_end cut); the rest becomes a new
        TODO task in the parent's place. A release is voluntary: it does not count as a retry.
        """
        if rows_consumed < 0:
            raise ValueError(f"rows_consumed must be >= 0, got {rows_consumed}")
        rec = self._records.get(task_id)
        if rec is None:
            return self._previous_epoch_answer(task_id, worker_id, rows_consumed)
        if rec.state is not TaskState.DOING or rec.worker_id != worker_id:
            repeat = rec.worker_id == worker_id and (
                (rec.state is TaskState.DONE and rec.task.rows == rows_consumed)
                or (rec.state is TaskState.TODO and rows_consumed == 0)
            )
            return Outcome.DUPLICATE if repeat else Outcome.STALE
        task = rec.task
        if rows_consumed >= task.rows:
            return self.done(task_id, worker_id)
        rec.deadline = None
        if rows_consumed == 0:
            rec.state = TaskState.TODO
            bisect.insort(self._todo, rec.key())
            return Outcome.ACCEPTED
        cut = task.row_start + rows_consumed
        rec.task = task.model_copy(update={"row_end": cut})
        rec.state = TaskState.DONE
        rest = Task(
            task_id=_task_id(task.epoch, task.shard, cut),
            epoch=task.epoch,
            shard=task.shard,
            row_start=cut,
            row_end=task.row_end,
        )
        self._add(_Record(task=rest, order=rec.order, retries=rec.retries))
        return Outcome.ACCEPTED

    def renew(self, worker_id: str, now: float) -> int:
        """Extend the deadlines of the worker's leases (a heartbeat). Returns how many were renewed."""
        n = 0
        for rec in self._records.values():
            if rec.state is TaskState.DOING and rec.worker_id == worker_id:
                rec.deadline = now + self.lease_timeout_s
                n += 1
        return n

    def expire(self, now: float) -> Requeued:
        """Take back every lease whose deadline has passed."""
        return self._take_back(lambda r: r.deadline is not None and r.deadline < now)

    def recover(self, worker_id: str | None = None) -> Requeued:
        """Take back the leases of a worker known to be dead (all leases when `worker_id` is None)."""
        return self._take_back(lambda r: worker_id is None or r.worker_id == worker_id)

    def observe_generation(self, generation: int) -> Requeued:
        """A worker of launch generation `generation` (e.g. torchrun's restart count) called in.

        A newer generation means the whole worker group was restarted: every lease taken in an older
        generation is dead and is taken back at once instead of waiting for its deadline.
        """
        if generation <= self.generation:
            return Requeued()
        self.generation = generation
        return self._take_back(lambda r: r.generation < generation)

    def held_by(self, worker_id: str) -> list[str]:
        """Ids of the tasks `worker_id` holds a lease on (DOING) in the current epoch."""
        return sorted(r.task.task_id for r in self._records.values()
                      if r.state is TaskState.DOING and r.worker_id == worker_id)

    def snapshot(self, progress: Mapping[str, int]) -> dict[str, Any]:
        """The data state a model checkpoint taken now must carry (see `recforge.train.recovery.resume`).

        `progress`: for tasks in flight, how many of their first rows the model has been trained on.
        In the returned state (a `to_dict()` document; the live queue is not changed) such a task's
        consumed prefix is DONE and its rest TODO; every other DOING task goes back to TODO without
        counting a retry (its rows are not in the model). Restoring it (`from_dict`) after a failure
        makes the master hand out exactly the rows the checkpointed model has not seen.
        """
        for task_id, rows in progress.items():
            rec = self._records.get(task_id)
            if rec is None or rec.state is not TaskState.DOING:
                raise ValueError(
                    f"snapshot: task {task_id!r} is not in flight in epoch {self.epoch} "
                    f"(state {rec.state.value if rec else 'unknown'}); cannot record progress on it"
                )
            if not 0 <= int(rows) <= rec.task.rows:
                raise ValueError(f"snapshot: progress {rows} on task {task_id!r} outside [0, {rec.task.rows}]")
        q = TaskQueue.from_dict(self.to_dict())
        for rec in sorted(q._records.values(), key=_Record.key):
            if rec.state is not TaskState.DOING:
                continue
            consumed = int(progress.get(rec.task.task_id, 0))
            rec.deadline = None
            if consumed >= rec.task.rows:
                rec.state = TaskState.DONE
                continue
            if consumed == 0:
                rec.state, rec.worker_id = TaskState.TODO, None
                bisect.insort(q._todo, rec.key())
                continue
            task = rec.task
            cut = task.row_start + consumed
            rec.task, rec.state = task.model_copy(update={"row_end": cut}), TaskState.DONE
            rest = Task(task_id=_task_id(task.epoch, task.shard, cut), epoch=task.epoch, shard=task.shard,
                        row_start=cut, row_end=task.row_end)
            q._add(_Record(task=rest, order=rec.order, retries=rec.retries))
        q._maybe_advance()
        return q.to_dict()

    def new_launch(self) -> Requeued:
        """A fresh launch of workers replaces all earlier ones: take back every lease, reset generations."""
        out = self.recover(None)
        self.generation = 0
        return out

    # ---- persistence ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "shard_rows": list(self.shard_rows),
            "rows_per_task": self.rows_per_task,
            "epochs": self.epochs,
            "lease_timeout_s": self.lease_timeout_s,
            "max_retries": self.max_retries,
            "shuffle_seed": self.shuffle_seed,
            "epoch": self.epoch,
            "generation": self.generation,
            "records": [r.to_dict() for r in sorted(self._records.values(), key=_Record.key)],
            "history": self.history,
            "poisoned": [t.model_dump() for t in self._poisoned],
            "prev_done": {k: list(v) for k, v in self._prev_done.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TaskQueue:
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"task queue state: unsupported version {d.get('version')!r} (expected {STATE_VERSION})")
        q = cls(
            d["shard_rows"],
            d["rows_per_task"],
            d["epochs"],
            lease_timeout_s=d["lease_timeout_s"],
            max_retries=d["max_retries"],
            shuffle_seed=d["shuffle_seed"],
        )
        q.epoch = int(d["epoch"])
        q.generation = int(d["generation"])
        q._records = {}
        q._todo = []
        for rd in d["records"]:
            q._add(_Record.from_dict(rd))
        q._history = [dict(h) for h in d["history"]]
        q._poisoned = [Task.model_validate(t) for t in d["poisoned"]]
        q._prev_done = {k: (str(v[0]), int(v[1])) for k, v in d["prev_done"].items()}
        return q

    # ---- internals -----------------------------------------------------------------------
    def _grant(self, action: Action, task: Task | None = None) -> Grant:
        return Grant(action=action, task=task, epoch=self.epoch, epochs=self.epochs)

    def _previous_epoch_answer(self, task_id: str, worker_id: str, rows: int | None) -> Outcome:
        # A repeat of the call that completed the previous epoch (e.g. a retried request) is a duplicate.
        prev = self._prev_done.get(task_id)
        if prev is None:
            return Outcome.UNKNOWN
        if prev[0] == worker_id and (rows is None or rows == prev[1]):
            return Outcome.DUPLICATE
        return Outcome.STALE

    def _add(self, rec: _Record) -> None:
        self._records[rec.task.task_id] = rec
        if rec.state is TaskState.TODO:
            bisect.insort(self._todo, rec.key())

    def _take_back(self, pred) -> Requeued:
        out = Requeued()
        for rec in list(self._records.values()):
            if rec.state is not TaskState.DOING or not pred(rec):
                continue
            rec.retries += 1
            rec.deadline = None
            if rec.retries >= self.max_retries:
                rec.state = TaskState.POISON
                self._poisoned.append(rec.task)
                out.poisoned.append(rec.task)
            else:
                rec.state = TaskState.TODO
                bisect.insort(self._todo, rec.key())
                out.requeued.append(rec.task)
        if out:
            self._maybe_advance()
        return out

    def _epoch_tasks(self, epoch: int) -> list[Task]:
        tasks = []
        for shard, n in enumerate(self.shard_rows):
            for start in range(0, n, self.rows_per_task):
                end = min(start + self.rows_per_task, n)
                tasks.append(Task(task_id=_task_id(epoch, shard, start), epoch=epoch, shard=shard, row_start=start,
                                  row_end=end))
        return tasks

    def _start_epoch(self) -> None:
        self._records = {}
        self._todo = []
        if self.finished:
            return
        tasks = self._epoch_tasks(self.epoch)
        orders = list(range(len(tasks)))
        if self.shuffle_seed is not None:
            random.Random(self.shuffle_seed * 1_000_003 + self.epoch).shuffle(orders)
        for task, order in zip(tasks, orders, strict=True):
            self._add(_Record(task=task, order=order))
        self._maybe_advance()  # an epoch without rows is complete at once

    def _maybe_advance(self) -> None:
        if self.finished or self._todo:
            return
        if any(r.state is TaskState.DOING for r in self._records.values()):
            return
        done = [r for r in self._records.values() if r.state is TaskState.DONE]
        self._history.append(
            {
                "epoch": self.epoch,
                "tasks_done": len(done),
                "rows_done": sum(r.task.rows for r in done),
                "tasks_poisoned": sum(1 for r in self._records.values() if r.state is TaskState.POISON),
            }
        )
        self._prev_done = {r.task.task_id: (r.worker_id or "", r.task.rows) for r in done}
        self.epoch += 1
        self._start_epoch()
