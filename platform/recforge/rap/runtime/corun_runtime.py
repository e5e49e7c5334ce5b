"""RAP runtime: a co-run schedule's fused kernels for batch i+1, launched at the stage boundaries of step i.

    runtime = CorunRuntime(executor, schedule, device)   # executor: the plan's FusedExecutor
    tracker = StageTracker(model, runtime.on_enter)      # each stage boundary opens that stage's gate
    pending = runtime.launch(padded_raw)                 # before step i: batch i+1's kernels wait for gates
    dense, kjt = pending.result()                        # before step i+1: leftovers run now, then wait

The output equals `executor(padded_raw)` bit for bit; only the kernels' start times move. Several jobs per rank
(RAP's mapping), CPU and CUDA: docs/rap.md#the-co-run-runtime.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.preprocess.batch import RawBatch
from recforge.preprocess.columns import BatchError, check_batch, finish
from recforge.rap.planning.schedule import CorunSchedule, ExecPart, ScheduleError, executable_parts
from recforge.rap.profiling.stages import STAGES

log = logging.getLogger(__name__)

Output = tuple[Tensor, KeyedJaggedTensor]


class CorunConfigError(ValueError):
    """The co-run setup does not fit the model / plan / machine; raised before training starts."""


def check_plan_in_sharding(plan_features: list[str], sharding: dict[str, Any]) -> None:
    """CorunConfigError naming the plan's sparse features that have no table in the sharding plan
    (`ShardedModel.plan_summary()`): their ids would have nowhere to go."""
    missing = [f for f in plan_features if f not in sharding]
    if missing:
        raise CorunConfigError(f"co-run: plan features {missing} are not tables of the sharding plan "
                               f"(tables: {sorted(sharding)[:10]}{'...' if len(sharding) > 10 else ''})")


class CorunJob(NamedTuple):
    """One fused plan the runtime runs each batch: its executor and its schedule (`jobs=` takes plain pairs too)."""

    executor: Any
    schedule: CorunSchedule

    @property
    def name(self) -> str:
        """The schedule's meta 'job' ('global' / 'local' from mapped_rank_schedules), else its plan's name."""
        return str(self.schedule.meta.get("job", self.schedule.plan_name))


@dataclass
class CycleTiming:
    """One batch's co-run: when its kernels ran inside the step and what the trainer waited for."""

    run_ms: dict[str, float] = field(default_factory=dict)  # per stage: kernel time on the co-run thread, all jobs
    job_run_ms: list[float] = field(default_factory=list)  # per job (job order): its kernel time, all stages
    opened_by_step: list[str] = field(default_factory=list)  # stages whose gate the training step opened
    wait_ms: float = 0.0  # result(): what the trainer waited (leftovers + unfinished work): the unhidden part


class _Cycle:
    """The gates of one batch: one threading.Event (and on CUDA one event on the training stream) per stage."""

    def __init__(self, stages: tuple[str, ...], cuda: bool, jobs: int) -> None:
        self.gates = {s: threading.Event() for s in stages}
        self.cuda_events: dict[str, Any] = {}
        self.cuda = cuda
        self.timing = CycleTiming(job_run_ms=[0.0] * jobs)

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
    """Batch i+1's preprocessing in flight; `results()` (or `result()` for one job) completes it, leftovers first."""

    def __init__(self, runtime: CorunRuntime, cycle: _Cycle, future: Future) -> None:
        self._runtime, self._cycle, self._future = runtime, cycle, future
        self._recorded = False

    @property
    def timing(self) -> CycleTiming:
        return self._cycle.timing

    def result(self) -> Output:
        """(dense, kjt) of a single-job runtime's batch."""
        if len(self._runtime.jobs) != 1:
            raise ValueError(f"this batch ran {len(self._runtime.jobs)} jobs {self._runtime.job_names()}: "
                             "use results(), one (dense, kjt) per job")
        return self.results()[0]

    def results(self) -> list[Output]:
        """One (dense, kjt) per job, in job order."""
        rt = self._runtime
        if rt._current is self._cycle:
            rt._current = None  # later stage boundaries belong to the next batch's cycle
        self._cycle.open_all()
        t0 = time.perf_counter()
        outputs = self._future.result()
        if rt.stream is not None:
            main = torch.cuda.current_stream(rt.device)
            main.wait_stream(rt.stream)
            # allocated on the side stream, used on the training stream: keep the allocator from reusing them early
            for dense, kjt in outputs:
                for t in (dense, kjt.values(), kjt.lengths()):
                    t.record_stream(main)
        if not self._recorded:  # a second call returns the same outputs and keeps the first wait
            self._recorded = True
            self._cycle.timing.wait_ms = (time.perf_counter() - t0) * 1e3
            rt.cycles.append(self._cycle.timing)
        return list(outputs)


class CorunRuntime:
    """Runs each job's schedule (validated against its executor's compiled plan here, so a bad schedule fails
    before training, with a ScheduleError naming the job and what is wrong).

    One job: `CorunRuntime(executor, schedule, device, threads)`; `launch(raw)`, `Pending.result()` and the
    `executor` / `schedule` / `compiled` / `parts` views work on single-job runtimes only (otherwise they raise,
    naming `jobs` / `launch_many` / `results`). Several jobs (keyword-only; each job its own executor):

        runtime = CorunRuntime(jobs=[(global_executor, global_schedule), (local_executor, local_schedule)],
                               device=device, threads=1)
        pending = runtime.launch_many([global_raw, local_raw])          # one raw batch per job, in job order
        (_, global_kjt), (local_dense, local_kjt) = pending.results()   # one (dense, kjt) per job

    At each stage gate the co-run thread runs job 0's parts of that stage, then job 1's, and so on; each job's
    output equals `job.executor(its raw)` bit for bit. A job whose schedule meta gives `rows` needs a raw batch
    of that many rows. `summary()` sums kernel time per stage, and predicted kernel time, over the jobs."""

    def __init__(self, executor=None, schedule: CorunSchedule | None = None, device: torch.device | str = "cpu",
                 threads: int = 1, *, jobs: Sequence[CorunJob | tuple[Any, CorunSchedule]] | None = None) -> None:
        if jobs is None:
            if executor is None or schedule is None:
                raise CorunConfigError("CorunRuntime: give an executor and a schedule, or jobs=[(executor, schedule)]")
            jobs = [(executor, schedule)]
        elif executor is not None or schedule is not None:
            raise CorunConfigError("CorunRuntime: give either an executor and a schedule or jobs=, not both")
        self.jobs: tuple[CorunJob, ...] = tuple(CorunJob(*j) for j in jobs)
        if not self.jobs:
            raise CorunConfigError("CorunRuntime: jobs is empty; give at least one (executor, schedule)")
        self.job_parts: tuple[list[ExecPart], ...] = tuple(self._parts(i, j) for i, j in enumerate(self.jobs))
        self.stages = tuple(s for s in STAGES if any(s in j.schedule.stages for j in self.jobs))
        self.device = torch.device(device)
        self.threads = threads
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            # a larger number is a lower priority; a static method, stubbed as an instance one
            least, _greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
            self.stream = torch.cuda.Stream(self.device, priority=least)
        elif threads > torch.get_num_threads():
            raise CorunConfigError(
                f"co-run threads={threads} exceeds the trainer's {torch.get_num_threads()} intra-op threads: "
                "torch sizes per-thread buffers by the process-wide count, so the co-run thread may use at most "
                "as many")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rap-corun")
        if self.device.type == "cpu":
            trainer_threads = torch.get_num_threads()
            self._pool.submit(_pin_threads, threads).result()
            torch.set_num_threads(trainer_threads)  # restores the process-wide count; the co-run thread keeps its own
        # per stage, per job: that job's parts of the stage, in schedule order
        self._by_stage: dict[str, list[list[ExecPart]]] = {s: [[] for _ in self.jobs] for s in self.stages}
        for ji, parts in enumerate(self.job_parts):
            for p in parts:
                self._by_stage[p.assignment.stage][ji].append(p)
        # per job: the stage where it runs as one executor call (every group whole in that stage), else None
        self.whole_stage: tuple[str | None, ...] = tuple(self._whole_stage(j, p) for j, p in
                                                         zip(self.jobs, self.job_parts, strict=True))
        self._current: _Cycle | None = None
        self.cycles: list[CycleTiming] = []

    def _parts(self, index: int, job: CorunJob) -> list[ExecPart]:
        for other in range(index):
            if self.jobs[other].executor is job.executor:
                raise CorunConfigError(f"jobs {other} and {index} share one executor: give each job its own "
                                       "(its kernel caches are keyed by its job's part keys)")
        if not hasattr(job.executor, "compiled") or not hasattr(job.executor, "run_group"):
            raise CorunConfigError(f"job {index} ({job.name!r}): {type(job.executor).__name__} is not a fused executor "
                                   "(make_executor('fused', plan, dataset)): the runtime runs its fused groups")
        try:
            return executable_parts(job.executor.compiled, job.schedule)
        except ScheduleError as e:
            if len(self.jobs) == 1:
                raise
            raise ScheduleError(f"job {index} ({job.name!r}, plan {job.executor.compiled.plan.name!r}): {e}") from None

    def _whole_stage(self, job: CorunJob, parts: list[ExecPart]) -> str | None:
        """On CPU, the one stage holding every fused group of `job` whole: there the co-run thread runs the batch
        as `job.executor(raw)`, the executor's single pass where it has one (one pass over the rows, where one call
        per group makes a pass per group); the output is the same. None: the parts run one by one."""
        stages = {p.assignment.stage for p in parts}
        n = len(job.executor.compiled.groups)
        if self.device.type != "cpu" or len(stages) != 1 or sorted(p.key for p in parts) != list(range(n)):
            return None
        return stages.pop()

    # ------------------------------------------------------------------ single-job views

    def _single(self, what: str) -> CorunJob:
        if len(self.jobs) != 1:
            raise AttributeError(f"CorunRuntime.{what}: this runtime runs {len(self.jobs)} jobs {self.job_names()}; "
                                 f"use runtime.jobs[i].{what if what != 'compiled' else 'executor.compiled'}")
        return self.jobs[0]

    @property
    def executor(self):
        return self._single("executor").executor

    @property
    def schedule(self) -> CorunSchedule:
        return self._single("schedule").schedule

    @property
    def compiled(self):
        return self._single("compiled").executor.compiled

    @property
    def parts(self) -> list[ExecPart]:
        self._single("parts")
        return self.job_parts[0]

    def job_names(self) -> list[str]:
        return [j.name for j in self.jobs]

    # ------------------------------------------------------------------ trainer side

    def launch(self, raw: RawBatch) -> Pending:
        """Start preprocessing `raw` (already padded to the batch size; on the CPU: on CUDA the co-run thread copies
        it on its stream); its stages wait for their gates. Single-job runtimes; see launch_many."""
        if len(self.jobs) != 1:
            raise ValueError(f"launch: this runtime runs {len(self.jobs)} jobs {self.job_names()}; use "
                             "launch_many with one raw batch per job")
        return self.launch_many([raw])

    def launch_many(self, raws: Sequence[RawBatch]) -> Pending:
        """Start preprocessing raws[i] with job i (each padded as its job expects); `Pending.results()` gives one
        (dense, kjt) per job. Bad input (count, columns, rows) fails here, in the trainer."""
        if isinstance(raws, RawBatch) or len(raws) != len(self.jobs):
            have = "a single RawBatch" if isinstance(raws, RawBatch) else f"{len(raws)} raw batches"
            raise ValueError(f"launch_many: {have} for {len(self.jobs)} jobs {self.job_names()}; give one raw "
                             "batch per job, in job order")
        for i, (job, raw) in enumerate(zip(self.jobs, raws, strict=True)):
            try:
                check_batch(raw, job.executor.dataset, job.executor.plan)
            except BatchError as e:
                raise BatchError(f"job {i} ({job.name!r}): {e}") from None
            want = job.schedule.meta.get("rows")
            if want is not None and raw.rows != int(want):
                raise BatchError(f"job {i} ({job.name!r}): raw batch has {raw.rows} rows, its schedule was planned "
                                 f"for {int(want)} (raw batches in job order: {self.job_names()})")
        cycle = _Cycle(self.stages, cuda=self.stream is not None, jobs=len(self.jobs))
        self._current = cycle
        return Pending(self, cycle, self._pool.submit(self._run, cycle, list(raws)))

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
        """Medians over the batches run so far: kernel time per stage (summed over the jobs), per job, and the
        trainer's wait (unhidden part); predicted kernel time summed over the jobs' schedules."""
        if not self.cycles:
            return {"batches": 0}
        run = {s: statistics.median(c.run_ms.get(s, 0.0) for c in self.cycles) for s in self.stages}
        out = {
            "batches": len(self.cycles),
            "kernel_ms_by_stage": {s: round(v, 4) for s, v in run.items() if v > 0},
            "kernel_ms": round(sum(run.values()), 4),
            "wait_ms": round(statistics.median(c.wait_ms for c in self.cycles), 4),
            "predicted_kernel_ms": round(sum(a.predicted_ms for j in self.jobs for a in j.schedule.assignments), 4),
            "stages_opened_by_step": round(statistics.mean(len(c.opened_by_step) for c in self.cycles), 3),
        }
        if len(self.jobs) > 1:
            out["kernel_ms_by_job"] = [
                {"job": j.name, "kernel_ms": round(statistics.median(c.job_run_ms[i] for c in self.cycles), 4),
                 "predicted_kernel_ms": round(sum(a.predicted_ms for a in j.schedule.assignments), 4)}
                for i, j in enumerate(self.jobs)]
        return out

    # ------------------------------------------------------------------ co-run thread

    def _run(self, cycle: _Cycle, raws: list[RawBatch]) -> list[Output]:
        if self.stream is None:
            return self._run_parts(cycle, raws)
        with torch.cuda.stream(self.stream):
            cycle.gates[self.stages[0]].wait()  # the copies too wait for the first stage
            return self._run_parts(cycle, [raw.to(self.device) for raw in raws])

    def _run_parts(self, cycle: _Cycle, raws: list[RawBatch]) -> list[Output]:
        vals: list[dict] = [{} for _ in self.jobs]
        whole: dict[int, Output] = {}  # jobs run as one executor call
        job_ms = cycle.timing.job_run_ms
        with torch.no_grad():
            for stage in self.stages:
                by_job = self._by_stage[stage]
                if not any(by_job):
                    continue
                cycle.gates[stage].wait()
                if stage in cycle.cuda_events and self.stream is not None:  # events only with a stream
                    self.stream.wait_event(cycle.cuda_events[stage])
                t0 = time.perf_counter()
                for ji, parts in enumerate(by_job):
                    if not parts:
                        continue
                    tj, executor = time.perf_counter(), self.jobs[ji].executor
                    if self.whole_stage[ji] == stage:
                        whole[ji] = executor(raws[ji])
                    else:
                        for p in parts:
                            executor.run_group(p.key, p.group, raws[ji], vals[ji])
                    job_ms[ji] += (time.perf_counter() - tj) * 1e3
                cycle.timing.run_ms[stage] = (time.perf_counter() - t0) * 1e3
            results = []
            for ji, (job, raw, v) in enumerate(zip(self.jobs, raws, vals, strict=True)):
                if ji in whole:
                    results.append(whole[ji])
                    continue
                compiled = job.executor.compiled
                outputs = {f: v[n] for f, n in compiled.graph.outputs.items()}
                results.append(finish(job.executor.plan, outputs, raw.rows, raw.dense.device))
            return results


def _pin_threads(n: int) -> None:
    """On the co-run thread: its OpenMP team size. torch initializes a thread's count lazily from the
    process-wide one at its first parallel op, so run one first, then set ours (it then sticks to this thread)."""
    torch.ones(1 << 18).sum()
    torch.set_num_threads(n)
