"""Dynamic data sharding (DLRover-RM section 5): the job master's task queue, pure logic, no I/O.

Every epoch the shards are cut into tasks of at most `rows_per_task` rows; a task moves TODO -> DOING (a lease)
-> DONE, at least once per row: an expired lease, or one of an older launch generation, goes back to TODO as a
retry, and the `max_retries`-th such failure quarantines the task as POISON. Time is passed in (`now`, wall-clock
seconds, so that deadlines survive persistence). `request()` decides a lease call; `Grant` lists its four answers.
Indexes (TODO keys, DOING records per worker, counts) keep every call independent of the queue's size; with
`track_changes()` the queue records what changed (`drain_changes`) for the master's incremental log.
Design: docs/fault_tolerance.md#data-shard-tasks.
"""
from __future__ import annotations

import bisect
import math
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
        t = self.task
        return {
            "task": {"task_id": t.task_id, "epoch": t.epoch, "shard": t.shard, "row_start": t.row_start,
                     "row_end": t.row_end},
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


def _todo_key(rec: _Record) -> tuple[int, int, str]:
    """Hand-out order reversed, so that taking the next TODO task pops the end of a list (no memmove)."""
    return (-rec.order, -rec.task.row_start, rec.task.task_id)


def _task_id(epoch: int, shard: int, row_start: int) -> str:
    # Unique within an epoch: task ranges of one epoch never overlap, so their starts differ.
    return f"e{epoch}-s{shard}-r{row_start}"


class TaskQueue:
    """TODO / DOING / DONE data-shard tasks over `epochs` passes of the data. Not thread-safe."""

    # the current epoch's records and their indexes (set by _reset_records)
    _records: dict[str, _Record]
    _todo: list[tuple[int, int, str]]
    _doing: dict[str, _Record]
    _held: dict[str, set[str]]
    _counts: dict[TaskState, int]
    _rows_done: int
    _min_deadline: float
    _bulk: bool

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
        self._history: list[dict[str, int]] = []  # one summary per completed epoch
        self._poisoned: list[Task] = []
        self._prev_done: dict[str, tuple[str, int]] = {}  # previous epoch's DONE tasks: completer, rows
        self._changes: list[tuple[str, Any]] | None = None  # see track_changes
        self._reset_records()
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
    def tasks_per_epoch(self) -> int:
        return sum(-(-n // self.rows_per_task) for n in self.shard_rows)

    @property
    def in_flight(self) -> int:
        """DOING tasks of the current epoch."""
        return len(self._doing)

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
        return {
            "epoch": self.epoch,
            "epochs": self.epochs,
            "finished": self.finished,
            "tasks": {s.value: self._counts[s] for s in TaskState},
            "rows_per_epoch": self.rows_per_epoch,
            "rows_done_this_epoch": self._rows_done,
            "rows_done_total": self._rows_done + sum(h["rows_done"] for h in self._history),
            "history": self.history,
            "poisoned": [t.model_dump() for t in self._poisoned],
            "generation": self.generation,
        }

    # ---- transitions ---------------------------------------------------------------------
    def lease(self, worker_id: str, now: float, generation: int = 0) -> Task | None:
        """Lease the next TODO task of the current epoch, or None when the epoch has nothing TODO."""
        if not self._todo:
            return None
        rec = self._records[self._todo[-1][2]]  # the next in hand-out order is at the end
        rec.worker_id = worker_id
        rec.deadline = now + self.lease_timeout_s
        rec.generation = generation
        self._move(rec, TaskState.DOING)
        self._min_deadline = min(self._min_deadline, rec.deadline)
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
            rec.deadline = None
            self._move(rec, TaskState.DONE)
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
            self._move(rec, TaskState.TODO)
            return Outcome.ACCEPTED
        self._split(rec, rows_consumed)
        return Outcome.ACCEPTED

    def renew(self, worker_id: str, now: float) -> int:
        """Extend the deadlines of the worker's leases (a heartbeat). Returns how many were renewed.
        Not a tracked change: a restarted master grants every lease a fresh deadline (`grace`)."""
        held = self._held.get(worker_id, ())
        for task_id in held:
            self._doing[task_id].deadline = now + self.lease_timeout_s
        return len(held)

    def grace(self, now: float) -> None:
        """Give every lease at least a full lease period from `now` (a master restarted from its log, which does
        not hold heartbeat renewals: the holders could not reach it meanwhile)."""
        for rec in self._doing.values():
            rec.deadline = max(rec.deadline or now, now + self.lease_timeout_s)
            self._touch(rec)
        self._min_deadline = min((r.deadline or math.inf for r in self._doing.values()), default=math.inf)

    def expire(self, now: float) -> Requeued:
        """Take back every lease whose deadline has passed."""
        if not self._min_deadline < now:  # the earliest deadline (a lower bound) has not passed: nothing to do
            return Requeued()
        out = self._take_back(lambda r: r.deadline is not None and r.deadline < now)
        self._min_deadline = min((r.deadline or math.inf for r in self._doing.values()), default=math.inf)
        return out

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
        self._set_generation(generation)
        return self._take_back(lambda r: r.generation < generation)

    def held_by(self, worker_id: str) -> list[str]:
        """Ids of the tasks `worker_id` holds a lease on (DOING) in the current epoch."""
        return sorted(self._held.get(worker_id, ()))

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
        for rec in sorted(q._doing.values(), key=_Record.key):
            consumed = int(progress.get(rec.task.task_id, 0))
            rec.deadline = None
            if consumed >= rec.task.rows:
                q._move(rec, TaskState.DONE)
            elif consumed == 0:
                q._move(rec, TaskState.TODO)
                rec.worker_id = None
            else:
                q._split(rec, consumed)
        q._maybe_advance()
        return q.to_dict()

    def new_launch(self) -> Requeued:
        """A fresh launch of workers replaces all earlier ones: take back every lease, reset generations."""
        out = self.recover(None)
        self._set_generation(0)
        return out

    # ---- change tracking (the master's incremental log) ----------------------------------------
    def track_changes(self) -> None:
        """From now on record changes for `drain_changes` (the master persists them)."""
        self._changes = []

    def drain_changes(self) -> list[tuple[str, Any]]:
        """What changed since the last drain, in order: ("rec", record dict) for a task record of the current
        epoch (upsert), ("poison", task dict) for a task quarantined, ("epoch", n) when the queue moved on to
        epoch n (its tasks are derived again on replay), ("gen", n) for a new launch generation.
        Replayed by `apply_change`; deadline renewals (heartbeats) are not changes."""
        if not self._changes:
            return []
        changes, self._changes = self._changes, []
        out: list[tuple[str, Any]] = []
        seen: set[int] = set()
        for kind, value in reversed(changes):  # the last state of a record counts; epochs split the list
            if kind == "rec":
                if id(value) in seen:
                    continue
                seen.add(id(value))
                out.append((kind, value.to_dict()))
            else:
                if kind == "epoch":
                    seen = set()
                out.append((kind, value))
        out.reverse()
        return out

    def apply_change(self, kind: str, value: Any) -> None:
        """Replay one change of `drain_changes` (restoring from the master's log)."""
        if kind == "rec":
            rec = _Record.from_dict(value)
            old = self._records.get(rec.task.task_id)
            if old is not None:
                self._forget(old)
            self._add(rec)
            if rec.deadline is not None:
                self._min_deadline = min(self._min_deadline, rec.deadline)
        elif kind == "poison":
            self._poisoned.append(Task.model_validate(value))
        elif kind == "epoch":
            if int(value) < self.epoch:
                raise ValueError(f"log: epoch {value} after epoch {self.epoch}")
            while self.epoch < int(value):
                self._advance()
        elif kind == "gen":
            self.generation = int(value)
        else:
            raise ValueError(f"log: unknown change {kind!r}")

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
        q._reset_records()
        q._bulk = True
        for rd in d["records"]:
            q._add(_Record.from_dict(rd))
        q._todo.sort()
        q._bulk = False
        q._history = [dict(h) for h in d["history"]]
        q._poisoned = [Task.model_validate(t) for t in d["poisoned"]]
        q._prev_done = {k: (str(v[0]), int(v[1])) for k, v in d["prev_done"].items()}
        q._min_deadline = min((r.deadline or math.inf for r in q._doing.values()), default=math.inf)
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

    def _reset_records(self) -> None:
        self._records = {}
        self._todo = []  # _todo_key of the TODO records, sorted: next one last
        self._doing = {}  # DOING records by task id
        self._held = {}  # worker id -> ids of the tasks it holds (DOING)
        self._counts = {s: 0 for s in TaskState}
        self._rows_done = 0  # rows of the DONE records (this epoch)
        self._min_deadline = math.inf  # a lower bound of the DOING deadlines
        self._bulk = False

    def _touch(self, rec: _Record) -> None:
        if self._changes is not None:
            self._changes.append(("rec", rec))

    def _set_generation(self, generation: int) -> None:
        self.generation = generation
        if self._changes is not None:
            self._changes.append(("gen", generation))

    def _index(self, rec: _Record, sign: int) -> None:
        """Count `rec` into (sign 1) or out of (sign -1) the indexes of its state."""
        tid = rec.task.task_id
        self._counts[rec.state] += sign
        if rec.state is TaskState.DOING:
            held = self._held.setdefault(rec.worker_id or "", set())
            if sign > 0:
                self._doing[tid] = rec
                held.add(tid)
            else:
                del self._doing[tid]
                held.discard(tid)
                if not held:
                    del self._held[rec.worker_id or ""]
        elif rec.state is TaskState.DONE:
            self._rows_done += sign * rec.task.rows
        elif rec.state is TaskState.TODO:
            key = _todo_key(rec)
            if sign > 0 and self._bulk:
                self._todo.append(key)  # sorted once at the end (from_dict)
            elif sign > 0:
                bisect.insort(self._todo, key)
            else:
                del self._todo[bisect.bisect_left(self._todo, key)]

    def _move(self, rec: _Record, state: TaskState) -> None:
        self._index(rec, -1)
        rec.state = state
        self._index(rec, 1)
        self._touch(rec)

    def _add(self, rec: _Record) -> None:
        self._records[rec.task.task_id] = rec
        self._index(rec, 1)
        self._touch(rec)

    def _forget(self, rec: _Record) -> None:
        self._index(rec, -1)
        del self._records[rec.task.task_id]

    def _split(self, rec: _Record, consumed: int) -> None:
        """A DOING task whose first `consumed` rows were trained: that prefix DONE, the rest a new TODO task."""
        task = rec.task
        cut = task.row_start + consumed
        self._index(rec, -1)
        rec.task = task.model_copy(update={"row_end": cut})
        rec.state = TaskState.DONE
        self._index(rec, 1)
        self._touch(rec)
        rest = Task(task_id=_task_id(task.epoch, task.shard, cut), epoch=task.epoch, shard=task.shard,
                    row_start=cut, row_end=task.row_end)
        self._add(_Record(task=rest, order=rec.order, retries=rec.retries))

    def _take_back(self, pred) -> Requeued:
        out = Requeued()
        for rec in list(self._doing.values()):
            if not pred(rec):
                continue
            rec.retries += 1
            rec.deadline = None
            if rec.retries >= self.max_retries:
                self._move(rec, TaskState.POISON)
                self._poisoned.append(rec.task)
                if self._changes is not None:
                    self._changes.append(("poison", rec.task.model_dump()))
                out.poisoned.append(rec.task)
            else:
                self._move(rec, TaskState.TODO)
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
        """The current epoch's tasks, all TODO (derived from the settings: not a tracked change)."""
        self._reset_records()
        if self.finished:
            return
        tasks = self._epoch_tasks(self.epoch)
        orders = list(range(len(tasks)))
        if self.shuffle_seed is not None:
            random.Random(self.shuffle_seed * 1_000_003 + self.epoch).shuffle(orders)
        for task, order in zip(tasks, orders, strict=True):
            rec = _Record(task=task, order=order)
            self._records[task.task_id] = rec
            self._todo.append(_todo_key(rec))
        self._todo.sort()
        self._counts[TaskState.TODO] = len(tasks)
        self._maybe_advance()  # an epoch without rows is complete at once

    def _maybe_advance(self) -> None:
        if self.finished or self._todo or self._doing:
            return
        self._advance()

    def _advance(self) -> None:
        """Close the current epoch (nothing TODO or DOING in it) and start the next one."""
        self._history.append(
            {
                "epoch": self.epoch,
                "tasks_done": self._counts[TaskState.DONE],
                "rows_done": self._rows_done,
                "tasks_poisoned": self._counts[TaskState.POISON],
            }
        )
        self._prev_done = {r.task.task_id: (r.worker_id or "", r.task.rows)
                           for r in self._records.values() if r.state is TaskState.DONE}
        self.epoch += 1
        if self._changes is not None:
            self._changes.append(("epoch", self.epoch))
        self._start_epoch()
