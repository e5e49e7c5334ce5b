"""RAP runtime: a co-run schedule's fused kernels for batch i+1, launched at the stage boundaries of step i.

    runtime = CorunRuntime(executor, schedule, device)        # executor: the plan's FusedExecutor
    tracker = StageTracker(model, runtime.on_enter)           # recforge.rap.stages: opens the stage gates
    pending = runtime.launch(padded_raw)                      # before step i: batch i+1's kernels wait for gates
    ... step i runs; on_enter(stage) opens that stage's gate and its kernels start ...
    dense, kjt = pending.result()                             # before step i+1: leftovers run now, then wait

`result()` opens every gate the step did not open (a stage it never reached, or no step at all: the first
batch), so the kernels of those stages are the leftovers completed before the next step starts. The output
equals `executor(padded_raw)` bit for bit: the same kernels on the same values, only their start times move.

CPU (what CI runs): one background thread with its own intra-op thread budget (OpenMP's thread count is a
per-thread setting; see `_pin_threads`). CUDA: the same thread enqueues each stage's kernels on a
lowest-priority stream after waiting for a CUDA event recorded on the training stream at the stage's start;
`result()` makes the training stream wait for that stream. The CUDA path has not run on a GPU yet.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.preprocess.batch import RawBatch
from recforge.preprocess.columns import check_batch, finish
from recforge.rap.schedule import CorunSchedule, ExecPart, executable_parts
from recforge.rap.stages import STAGES

log = logging.getLogger(__name__)


class CorunConfigError(ValueError):
    """The co-run setup does not fit the model / plan / machine; raised before training starts."""


def check_plan_in_sharding(plan_features: list[str], sharding: dict[str, Any]) -> None:
    """CorunConfigError naming the plan's sparse features that have no table in the sharding plan
    (`ShardedModel.plan_summary()`): their ids would have nowhere to go."""
    missing = [f for f in plan_features if f not in sharding]
    if missing:
        raise CorunConfigError(f"co-run: plan features {missing} are not tables of the sharding plan "
                               f"(tables: {sorted(sharding)[:10]}{'...' if len(sharding) > 10 else ''})")


@dataclass
class CycleTiming:
    """One batch's co-run: when its kernels ran inside the step and what the trainer waited for."""

    run_ms: dict[str, float] = field(default_factory=dict)  # per stage: kernel time on the co-run thread
    opened_by_step: list[str] = field(default_factory=list)  # stages whose gate the training step opened
    wait_ms: float = 0.0  # result(): what the trainer waited (leftovers + unfinished work): the unhidden part


class _Cycle:
    """The gates of one batch: one threading.Event (and on CUDA one event on the training stream) per stage."""

    def __init__(self, stages: tuple[str, ...], cuda: bool) -> None:
        self.gates = {s: threading.Event() for s in stages}
        self.cuda_events: dict[str, Any] = {}
        self.cuda = cuda
        self.timing = CycleTiming()

    def open(self, stage: str, by_step: bool) -> None:
        gate = self.gates.get(stage)
        if gate is None or gate.is_set():
            return
        if by_step:
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record()  # on the training stream: the stage's kernels start after what it queued so far
                self.cuda_events[stage] = ev
            self.timing.opened_by_step.append(stage)
        gate.set()

    def open_all(self) -> None:
        for s in self.gates:
            self.open(s, by_step=False)


class Pending:
    """Batch i+1's preprocessing in flight; `result()` completes it (leftovers first) and returns its output."""

    def __init__(self, runtime: "CorunRuntime", cycle: _Cycle, future: Future) -> None:
        self._runtime, self._cycle, self._future = runtime, cycle, future

    @property
    def timing(self) -> CycleTiming:
        return self._cycle.timing

    def result(self) -> tuple[Tensor, KeyedJaggedTensor]:
        rt = self._runtime
        if rt._current is self._cycle:
            rt._current = None  # later stage boundaries belong to the next batch's cycle
        self._cycle.open_all()
        t0 = time.perf_counter()
        dense, kjt = self._future.result()
        if rt.stream is not None:
            main = torch.cuda.current_stream(rt.device)
            main.wait_stream(rt.stream)
            # allocated on the side stream, used on the training stream: keep the allocator from reusing them early
            for t in (dense, kjt.values(), kjt.lengths()):
                t.record_stream(main)
        self._cycle.timing.wait_ms = (time.perf_counter() - t0) * 1e3
        rt.cycles.append(self._cycle.timing)
        return dense, kjt


class CorunRuntime:
    """Runs `schedule` (validated against `executor.compiled` here, so a bad schedule fails before training)."""

    def __init__(self, executor, schedule: CorunSchedule, device: torch.device | str = "cpu",
                 threads: int = 1) -> None:
        self.executor = executor
        self.compiled = executor.compiled
        self.schedule = schedule
        self.parts: list[ExecPart] = executable_parts(self.compiled, schedule)  # ScheduleError names what is wrong
        self.stages = tuple(s for s in STAGES if s in schedule.stages)
        self.device = torch.device(device)
        self.threads = threads
        self.stream = None
        if self.device.type == "cuda":
            least, _greatest = torch.cuda.Stream.priority_range()  # a larger number is a lower priority
            self.stream = torch.cuda.Stream(self.device, priority=least)
        elif threads > torch.get_num_threads():
            raise CorunConfigError(
                f"co-run threads={threads} exceeds the trainer's {torch.get_num_threads()} intra-op threads: "
                "torch sizes per-thread buffers by the process-wide count, so the co-run thread may use at most as many")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rap-corun")
        if self.device.type == "cpu":
            trainer_threads = torch.get_num_threads()
            self._pool.submit(_pin_threads, threads).result()
            torch.set_num_threads(trainer_threads)  # restores the process-wide count; the co-run thread keeps its own
        self._by_stage: dict[str, list[ExecPart]] = {s: [] for s in self.stages}
        for p in self.parts:
            self._by_stage[p.assignment.stage].append(p)
        self._current: _Cycle | None = None
        self.cycles: list[CycleTiming] = []

    # ------------------------------------------------------------------ trainer side

    def launch(self, raw: RawBatch) -> Pending:
        """Start preprocessing `raw` (already padded to the batch size; on the CPU: on CUDA the co-run thread copies
        it on its stream); its stages wait for their gates."""
        check_batch(raw, self.executor.dataset, self.executor.plan)  # a bad batch fails here, in the trainer
        cycle = _Cycle(self.stages, cuda=self.stream is not None)
        self._current = cycle
        return Pending(self, cycle, self._pool.submit(self._run, cycle, raw))

    def on_enter(self, stage: str) -> None:
        """StageTracker callback: the training step entered `stage`; the pending batch's kernels of it may start."""
        cycle = self._current
        if cycle is not None:
            cycle.open(stage, by_step=True)

    def close(self) -> None:
        if self._current is not None:
            self._current.open_all()
        self._pool.shutdown(wait=True)

    def summary(self) -> dict[str, Any]:
        """Medians over the batches run so far: kernel time per stage and the trainer's wait (unhidden part)."""
        if not self.cycles:
            return {"batches": 0}
        run = {s: statistics.median(c.run_ms.get(s, 0.0) for c in self.cycles) for s in self.stages}
        return {
            "batches": len(self.cycles),
            "kernel_ms_by_stage": {s: round(v, 4) for s, v in run.items() if v > 0},
            "kernel_ms": round(sum(run.values()), 4),
            "wait_ms": round(statistics.median(c.wait_ms for c in self.cycles), 4),
            "predicted_kernel_ms": round(sum(a.predicted_ms for a in self.schedule.assignments), 4),
            "stages_opened_by_step": round(statistics.mean(len(c.opened_by_step) for c in self.cycles), 3),
        }

    # ------------------------------------------------------------------ co-run thread

    def _run(self, cycle: _Cycle, raw: RawBatch) -> tuple[Tensor, KeyedJaggedTensor]:
        if self.stream is None:
            return self._run_parts(cycle, raw)
        with torch.cuda.stream(self.stream):
            cycle.gates[self.stages[0]].wait()  # the copy too waits for the first stage
            return self._run_parts(cycle, raw.to(self.device))

    def _run_parts(self, cycle: _Cycle, raw: RawBatch) -> tuple[Tensor, KeyedJaggedTensor]:
        vals: dict = {}
        with torch.no_grad():
            for stage in self.stages:
                if not self._by_stage[stage]:
                    continue
                cycle.gates[stage].wait()
                if stage in cycle.cuda_events:
                    self.stream.wait_event(cycle.cuda_events[stage])
                t0 = time.perf_counter()
                for p in self._by_stage[stage]:
                    self.executor.run_group(p.key, p.group, raw, vals)
                cycle.timing.run_ms[stage] = (time.perf_counter() - t0) * 1e3
            outputs = {f: vals[n] for f, n in self.compiled.graph.outputs.items()}
            return finish(self.executor.plan, outputs, raw.rows, raw.dense.device)


def _pin_threads(n: int) -> None:
    """On the co-run thread: its OpenMP team size. torch initializes a thread's count lazily from the
    process-wide one at its first parallel op, so run one first, then set ours (it then sticks to this thread)."""
    torch.ones(1 << 18).sum()
    torch.set_num_threads(n)
