"""A rank's steps prepared ahead on a background thread: lease, read, preprocess and the step's global counts.

`PrefetchBatches` wraps a TaskBatches-like source (inline or offline; RAP's co-run source keeps its own read-ahead).
One thread owns the source: it builds the next `depth` steps (each `accumulation` batches) while the current one
trains, all-reduces the steps' [has_data, real_rows] on a separate gloo group, `counts_per_reduce` steps in one
collective (so the step loop never blocks on it, the loss stays exactly normalized, and the side group's
collectives, which take CPU beside the lockstep step, are few) and reports trained tasks done to the master (the
trainer's `trained` calls are queued to it, in order). `progress()` (the checkpoint's data state) first waits until
every queued report was made, then counts only rows handed to the trainer, as the co-run source does. Design:
docs/performance.md#training-against-torchrecs-reference-loop.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from recforge.train.loop.batches import Batch

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0


class StepSource(Protocol):
    """What PrefetchBatches drives (TaskBatches and its subclasses)."""

    tasks_done: int

    def next(self) -> Batch | None: ...
    def trained(self, batch: Batch) -> None: ...
    def progress(self) -> dict[str, int]: ...


@dataclass
class Step:
    """One optimizer step's micro-batches (None where this rank had no data) with the global counts the loss needs."""

    micro: list[Batch | None]
    g_has: float  # ranks with data this step (0: the epoch is over on every rank)
    g_real: float  # real rows of the step over all ranks
    progress: dict[str, int] = field(default_factory=dict)  # the source's progress after its last batch was read

    @property
    def real(self) -> int:
        return sum(b.real for b in self.micro if b is not None)


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class PrefetchBatches:
    """Steps of `source` built `depth` ahead on a thread (see the module doc). `group`: the process group of the
    steps' count all_reduce (a separate gloo group from the model's; None with world_size 1). `counts_per_reduce`:
    steps built and counted per all_reduce (every rank must use the same value); the thread starts the next such
    group of steps while fewer than `depth` wait, so up to depth + counts_per_reduce - 1 steps are held ahead. Every
    wait is bounded by `timeout_s`."""

    def __init__(self, source: StepSource, *, accumulation: int = 1, depth: int = 2,
                 group: dist.ProcessGroup | None = None, world_size: int = 1,
                 timeout_s: float = DEFAULT_TIMEOUT_S, idle_priority: bool = False,
                 counts_per_reduce: int = 1) -> None:
        if accumulation < 1 or depth < 1 or counts_per_reduce < 1:
            raise ValueError(f"PrefetchBatches: accumulation ({accumulation}), depth ({depth}) and counts_per_reduce "
                             f"({counts_per_reduce}) must be >= 1")
        if world_size > 1 and group is None:
            raise ValueError("PrefetchBatches: world_size > 1 needs the process group of the per-step all_reduce")
        self.source, self.accumulation, self.depth = source, accumulation, depth
        self.counts_per_reduce = counts_per_reduce
        self.group, self.world_size, self.timeout_s = group, world_size, timeout_s
        self.idle_priority = idle_priority  # the thread under SCHED_IDLE: it runs when its rank's cores would idle
        self._ready: queue.Queue[Step | None | _Failed] = queue.Queue()
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._produced = 0  # steps built (thread side)
        self._taken_seen = 0  # "taken" messages the thread has read
        self._taken = 0  # steps handed to the trainer (trainer side)
        self._ended = False  # the thread built the epoch's end (thread side)
        self._finished = False  # the trainer took the epoch's end
        self._stopping = False
        self._error: BaseException | None = None
        self._handed: dict[str, int] = {}
        # defer_progress(): the progress of steps handed out but not trained yet, oldest first
        self._deferred: collections.deque[dict[str, int]] | None = None
        # the thread's wall seconds building steps / reporting trained, and its CPU seconds in all
        self.thread_s = {"build": 0.0, "report": 0.0, "cpu": 0.0}
        self._work = threading.Lock()  # held by the thread while it reads and preprocesses (see paused)

    # ---- trainer side ---------------------------------------------------------------------
    def next_step(self) -> Step | None:
        """The next step (None at the epoch's end on every rank)."""
        if self._finished:
            return None
        self._start()
        try:
            item = self._ready.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"PrefetchBatches: no step within {self.timeout_s}s (step {self._taken + 1}): the "
                               "reading thread is stuck (job master, shard reads or the other ranks)") from None
        if isinstance(item, _Failed):
            self._finished = True
            raise RuntimeError(f"PrefetchBatches: preparing step {self._taken + 1} failed: {item.error!r}") \
                from item.error
        if item is None:
            self._finished = True
            return None
        self._taken += 1
        self._inbox.put(("taken", None))
        last = next((b for b in reversed(item.micro) if b is not None), None)
        if last is not None:
            if self._deferred is None:
                self._handed = dict(item.progress)
            else:
                self._deferred.append(dict(item.progress))
        return item

    def defer_progress(self) -> None:
        """Count a step's rows in `progress()` only once it was trained (`trained` for its batch), not when it is
        handed out: for a loop that holds steps in flight (recforge.train.loop.pipelined), where a checkpoint taken
        between steps must not claim the rows of steps handed out but not trained yet. Accumulation 1 only; call
        before the first step."""
        if self.accumulation != 1:
            raise RuntimeError(f"PrefetchBatches.defer_progress: accumulation {self.accumulation}; only 1 is supported")
        if self._taken:
            raise RuntimeError("PrefetchBatches.defer_progress: steps were already handed out")
        self._deferred = collections.deque()

    def next(self) -> Batch | None:
        """One batch (accumulation 1 only): the TaskBatches interface over next_step."""
        if self.accumulation != 1:
            raise RuntimeError("PrefetchBatches.next: use next_step() with accumulation > 1")
        step = self.next_step()
        return step.micro[0] if step is not None else None

    def trained(self, batch: Batch) -> None:
        """The trainer trained `batch`: its ledger record and done report are made on the thread, in order."""
        if self._deferred is not None:  # one batch per step: this is the oldest step handed out
            if not self._deferred:
                raise RuntimeError(f"PrefetchBatches.trained: batch {batch.task_id} rows [{batch.row_start}, "
                                   f"{batch.row_end}) was not handed out, or was reported trained twice")
            self._handed = self._deferred.popleft()
        if batch.last_of_task and batch.task_id is not None:
            self._handed.pop(batch.task_id, None)
        if self._thread is None:
            self.source.trained(batch)
        else:
            self._inbox.put(("trained", batch))

    def flush(self) -> None:
        """Wait until every queued `trained` call was made (done reports sent); TimeoutError after timeout_s."""
        if self._thread is None or not self._thread.is_alive():
            if self._error is not None:
                raise RuntimeError(f"PrefetchBatches: the reading thread failed: {self._error!r}") from self._error
            return
        ev = threading.Event()
        self._inbox.put(("flush", ev))
        if not ev.wait(self.timeout_s):
            raise TimeoutError(f"PrefetchBatches: done reports not sent within {self.timeout_s}s")
        if self._error is not None:
            raise RuntimeError(f"PrefetchBatches: the reading thread failed: {self._error!r}") from self._error

    def progress(self) -> dict[str, int]:
        """{task id: rows handed to the trainer} of tasks in flight, after flushing the done reports: the data
        state a checkpoint stores (rows read ahead are not in it; the master hands them out again on restore)."""
        self.flush()
        return dict(self._handed)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the thread between batches (it may still all_reduce a built step's counts or report trained ones):
        torch.fx patches nn.Module calls process-wide while it traces a model (the pipelined loop's first step), and a
        module run by the preprocessing on this thread meanwhile would be recorded into, and fail, that trace."""
        if not self._work.acquire(timeout=self.timeout_s):
            raise TimeoutError(f"PrefetchBatches: the reading thread did not pause within {self.timeout_s}s")
        try:
            yield
        finally:
            self._work.release()

    @property
    def tasks_done(self) -> int:
        return self.source.tasks_done

    def close(self) -> None:
        """Flush, then stop the thread. It first builds groups of steps until `depth` wait, as every rank's thread
        does, so the count all_reduces stay matched across ranks."""
        if self._thread is None:
            return
        try:
            self.flush()
        finally:
            self._inbox.put(("stop", None))
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                log.warning("PrefetchBatches: the reading thread did not stop within %.0fs", self.timeout_s)
            self._thread = None

    # ---- thread side ----------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None and not self._finished:
            self._thread = threading.Thread(target=self._run, name="recforge-prefetch", daemon=True)
            self._thread.start()

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "trained":
            t = time.perf_counter()
            self.source.trained(arg)
            self.thread_s["report"] += time.perf_counter() - t
        elif kind == "flush":
            arg.set()
        elif kind == "stop":
            self._stopping = True
        # "taken": only wakes the thread

    def _drain(self) -> None:
        """Handle everything queued so far, without blocking (done reports and flushes wait no longer than a read)."""
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._taken_seen += kind == "taken"
            self._handle(kind, arg)

    def _full(self) -> bool:
        return self._ended or self._produced - self._taken_seen >= self.depth

    def _run(self) -> None:
        if self.idle_priority:
            try:  # pid 0: this thread only (Linux schedules threads; the trainer's thread keeps its policy)
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            except (AttributeError, OSError) as e:  # not Linux, or not allowed: the thread runs at normal priority
                log.warning("PrefetchBatches: SCHED_IDLE not set on the reading thread (%r)", e)
                self.idle_priority = False
        c0 = time.thread_time()
        try:
            self._loop()
        finally:
            self.thread_s["cpu"] += time.thread_time() - c0

    def _loop(self) -> None:
        try:
            while True:
                self._drain()
                if self._full():
                    if self._stopping:
                        return
                    try:
                        kind, arg = self._inbox.get(timeout=self.timeout_s)
                    except queue.Empty:
                        continue
                    self._taken_seen += kind == "taken"
                    self._handle(kind, arg)
                    continue
                t = time.perf_counter()
                steps = self._build()
                self.thread_s["build"] += time.perf_counter() - t
                for step in steps:
                    self._produced += 1
                    if step is None:
                        self._ended = True
                    self._ready.put(step)
        except BaseException as e:  # handed to the trainer, which raises it
            self._error = e
            self._ready.put(_Failed(e))
            while True:  # answer flushes so the trainer never waits out its timeout on a dead thread
                try:
                    kind, arg = self._inbox.get(timeout=1.0)
                except queue.Empty:
                    if self._stopping:
                        return
                    continue
                if kind == "flush":
                    arg.set()
                elif kind == "stop":
                    return

    def _read_step(self) -> tuple[list[Batch | None], dict[str, int]]:
        micro: list[Batch | None] = []
        with self._work:
            for _ in range(self.accumulation):  # none asked for after the source ran dry
                micro.append(self.source.next() if not micro or micro[-1] is not None else None)
            progress = self.source.progress()
        return micro, progress

    def _build(self) -> list[Step | None]:
        """The next `counts_per_reduce` steps with their global counts from one all_reduce, up to the epoch's end
        (None: the first step no rank has data for; the steps after it are dropped, every rank sees the same)."""
        read = []
        for i in range(self.counts_per_reduce):
            if i:
                self._drain()  # between reads: the trainer's done reports and flushes do not wait for the group
            read.append(self._read_step())
        counts = torch.tensor([[1.0 if micro[0] is not None else 0.0,
                                float(sum(b.real for b in micro if b is not None))] for micro, _ in read],
                              dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(counts, group=self.group)
        steps: list[Step | None] = []
        for (micro, progress), (g_has, g_real) in zip(read, counts.tolist(), strict=True):
            if g_has == 0:
                steps.append(None)
                break
            steps.append(Step(micro=micro, g_has=g_has, g_real=g_real, progress=progress))
        return steps
