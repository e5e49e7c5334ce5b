"""The job supervisor: launch the worker group, watch it, relaunch it, rescale it.

One loop per job, next to the job master (run_training_job). Every launch gets a fresh launch-generation base
and worker spec; while the group runs, the supervisor watches for a hang, a scale decision (`scaler`, or POST
/scale to the master) and the overall timeout. When the group exits the job is done, relaunched at a new size or
shape (a `Rescale`), relaunched after a failure as the `FailoverPolicy` decides, or given up with a
JobFailedError naming the reason. A shutdown is not a failure: once `shutdown()` was called (the owner's SIGTERM,
recforge.elastic.shutdown), the master stopped, or the group was terminated from outside (the backend's
`terminated_by`), the group is stopped, nothing is relaunched and JobCancelled is raised.
Design: docs/fault_tolerance.md#the-supervisor and #shutdown-and-orphans.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recforge.elastic.backends.base import Backend, JobFailedError
from recforge.elastic.master.failover import FailoverPolicy, Failure, read_records
from recforge.elastic.master.service import JobMaster, MasterRejection
from recforge.elastic.policy import ResourcePlan
from recforge.elastic.shutdown import JobCancelled

log = logging.getLogger(__name__)

# (generation_base, grad_accumulation, plan) -> the worker spec path for this launch
SpecWriter = Callable[[int, int, ResourcePlan], Path]


@dataclass
class Rescale:
    """A scaler's decision beyond a worker count. `on_applied(applied, note)` is called once: with True
    when the relaunch carrying it starts, with False and the reason when it cannot be carried out."""

    workers: int
    threads_per_worker: int | None = None
    reason: str = "scaler decision"
    grad_accumulation_factor: int = 1      # multiply the micro-batches per step (halves the per-rank batch at 2)
    memory_factor: float | None = None     # multiply the pod memory (backends with grow_memory)
    relaunch: bool = False                 # relaunch even when the plan stays the same (replace a straggler)
    immediate: bool = False                # kill the group now instead of a checkpoint-and-stop
    on_applied: Callable[[bool, str], None] | None = field(default=None, repr=False, compare=False)

    def changes(self, plan: ResourcePlan) -> bool:
        return (self.workers != plan.workers
                or (self.threads_per_worker or plan.threads_per_worker) != plan.threads_per_worker
                or self.grad_accumulation_factor != 1 or self.memory_factor is not None or self.relaunch)

    def plan_after(self, plan: ResourcePlan) -> ResourcePlan:
        return ResourcePlan(workers=self.workers, threads_per_worker=self.threads_per_worker or plan.threads_per_worker)

    def report(self, applied: bool, note: str = "") -> None:
        if self.on_applied is not None:
            self.on_applied(applied, note)
            self.on_applied = None


# (master state, the plan the group runs) -> desired number of workers or a Rescale (None: keep)
Scaler = Callable[[dict[str, Any], ResourcePlan], "int | Rescale | None"]


@dataclass
class Attempt:
    generations: list[int]
    workers: int
    grad_accumulation: int
    exit_code: int | None
    outcome: str  # "finished" | "rescaled" | "failed" | "stopped" (a shutdown, or the group stopped on its own)
    failure: str | None = None
    decision: str | None = None
    wall_s: float = 0.0
    relaunched: bool = False  # a failed launch the failover policy relaunched


@dataclass
class SupervisorResult:
    exit_code: int
    plan: ResourcePlan
    handle: Any
    attempts: list[Attempt] = field(default_factory=list)
    restarts: int = 0
    grad_accumulation: int = 1

    def attempts_dicts(self) -> list[dict[str, Any]]:
        return [asdict(a) for a in self.attempts]


class Supervisor:
    def __init__(
        self, master: JobMaster, backend: Backend, failover: FailoverPolicy, write_spec: SpecWriter, *,
        plan: ResourcePlan, batch_size: int, global_batch: int | None = None, failures_dir: Path | None = None,
        persister: Any = None, scaler: Scaler | None = None, timeout_s: float | None = None, poll_s: float = 0.5,
        first_generation: int = 0, on_attempt: Callable[[Attempt], None] | None = None,
    ) -> None:
        """`batch_size`: the most rows a rank may train in one forward (train.batch_size); `global_batch`:
        rows per optimizer step over all ranks, kept across rescales (default: plan.workers * batch_size).
        `first_generation`: the first launch's generation base (above every generation an earlier run of
        this job used, so ledgers and failure records of different launches never alias).
        `on_attempt`: called with each launch's record once its outcome is decided (e.g. to persist it)."""
        self.master, self.backend, self.failover, self.write_spec = master, backend, failover, write_spec
        self.plan, self.batch_size = plan, batch_size
        self.global_batch = global_batch if global_batch is not None else plan.workers * batch_size
        self.oom_factor = 1  # doubled by each out-of-memory failover
        self.grad_accumulation = self.accumulation(plan.workers)
        master.scale_check = self.check_scale
        self.failures_dir, self.persister, self.scaler = failures_dir, persister, scaler
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.attempts: list[Attempt] = []
        self.failures: list[Failure] = []
        self.restarts = 0
        self.handle: Any = None
        self.first_generation = first_generation
        self.on_attempt = on_attempt
        self._decision: Rescale | None = None  # the scaler's decision behind the master's pending scale request
        self._relaunch_now: Rescale | None = None
        self._launched_at = time.monotonic()
        self._shutdown = threading.Event()
        self._shutdown_reason = ""
        self._open: tuple[Any, list[int], float] | None = None  # the running launch, not yet recorded

    def shutdown(self, reason: str = "shutdown requested") -> None:
        """Stop the running group and relaunch nothing (callable from a signal handler or another thread)."""
        if not self._shutdown.is_set():
            self._shutdown_reason = reason
            self._shutdown.set()

    def _stopping(self) -> str | None:
        """Why the job is shutting down (a shutdown() call, the master stopped), or None."""
        if self._shutdown.is_set():
            return self._shutdown_reason
        if getattr(self.master, "stopping", False):
            return "the job master stopped"
        return None

    def run(self) -> SupervisorResult:
        """Launch, watch and relaunch until the job is done; JobCancelled on a shutdown (the group stopped)."""
        try:
            return self._run()
        except (JobCancelled, KeyboardInterrupt) as e:  # the owner's SIGTERM / SIGINT raised in the middle of a launch
            self.shutdown(str(e) or type(e).__name__)
            if self._open is not None:
                handle, generations, t0 = self._open
                self._open = None
                self.backend.stop(handle)
                attempt = Attempt(generations=generations, workers=self.plan.workers,
                                  grad_accumulation=self.grad_accumulation,
                                  exit_code=getattr(handle, "exit_code", None), outcome="stopped",
                                  decision=f"shutdown, not relaunched: {e or type(e).__name__}",
                                  wall_s=time.monotonic() - t0)
                self.attempts.append(attempt)
                self._record(attempt)
            raise

    def _run(self) -> SupervisorResult:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        base = max(self.first_generation, self.master.queue.generation)
        while True:
            why = self._stopping()
            if why is not None:  # nothing is launched during a shutdown
                raise JobCancelled(f"{why}: no worker group launched")
            self.grad_accumulation = self.accumulation(self.plan.workers)
            spec_path = self.write_spec(base, self.grad_accumulation, self.plan)
            self.master.touch_progress()
            t0 = self._launched_at = time.monotonic()
            log.info("launch: %d worker(s), generation %d, gradient accumulation %d", self.plan.workers, base,
                     self.grad_accumulation)
            self.handle = handle = self.backend.launch(spec_path, self.plan)
            self._open = (handle, [base], t0)
            code, hang = self._watch(handle, deadline, base)
            self.backend.stop(handle)  # what is left of the group (a pod still running next to a failed one)
            span = max(int(getattr(self.backend, "max_restarts", 0)), self.master.queue.generation - base, 0)
            generations = list(range(base, base + span + 1))
            self.restarts += max(0, self.master.queue.generation - base)  # torchrun's own restarts
            attempt = Attempt(generations=generations, workers=self.plan.workers,
                              grad_accumulation=self.grad_accumulation, exit_code=code, outcome="failed",
                              wall_s=time.monotonic() - t0)
            self.attempts.append(attempt)
            self._open = None
            base = base + span + 1
            finished = code == 0 and hang is None and self.master.queue.finished
            why = None if finished else self._stopping() or self._terminated(handle, code, hang)
            if why is not None:  # a shutdown, not a failure: relaunch nothing
                attempt.outcome, attempt.decision = "stopped", f"shutdown, not relaunched: {why}"
                self._drop_decision("the job is shutting down")
                self._record(attempt)
                log.warning("worker group stopped by a shutdown (%s): nothing is relaunched", why)
                raise JobCancelled(f"{why}: the worker group was stopped and is not relaunched")
            now, self._relaunch_now = self._relaunch_now, None
            if now is not None:  # killed on the scaler's word (pods pending): not a failure
                attempt.outcome = "rescaled"
                attempt.decision = self._apply(now, now.reason)
                self._record(attempt)
                continue
            if code == 0 and hang is None:
                scale = self.master.take_scale()
                if self.master.queue.finished or scale is None:
                    attempt.outcome = "finished" if self.master.queue.finished else "stopped"
                    self._drop_decision("the job finished first")
                    self._record(attempt)
                    return self._result(code)
                attempt.outcome = "rescaled"
                attempt.decision = self._apply(self._decision_for(scale), scale["reason"])
                self._record(attempt)
                continue
            if self.persister is not None:
                self.persister.persist_now()  # what the dead group left in shared memory
            oom_killed = bool(getattr(handle, "oom_killed", False))
            failure = Failure.from_launch(code, read_records(self.failures_dir, range(generations[0], base)),
                                          generations, hang=hang is not None, detail=hang or "", oom_killed=oom_killed)
            decision = self.failover.decide(failure, self.failures, restarts_used=self.restarts,
                                            batch_size=self.global_batch // self.plan.workers,
                                            grad_accumulation=self.grad_accumulation)
            self.failures.append(failure)
            attempt.failure, attempt.decision = failure.describe(), decision.reason
            attempt.relaunched = decision.relaunch
            self._record(attempt)
            if not decision.relaunch:
                raise self._give_up(decision.reason, code, handle)
            log.warning("worker group of generation(s) %s failed: %s", failure.generations, decision.reason)
            self.restarts += 1
            if decision.grad_accumulation is not None:
                self.oom_factor *= decision.grad_accumulation // self.grad_accumulation
            if decision.memory_factor is not None and hasattr(self.backend, "grow_memory"):
                self.backend.grow_memory(decision.memory_factor)
            scale = self.master.take_scale()  # a rescale asked for while the group was failing still applies
            if scale is not None:
                self._apply(self._decision_for(scale), scale["reason"])

    def accumulation(self, workers: int) -> int:
        """Micro-batches per step at `workers` ranks: enough that none exceeds batch_size, times the
        out-of-memory factor, and dividing the rank's share of the global batch."""
        rows = self.global_batch // workers
        k = -(-rows // self.batch_size)
        while rows % k:
            k += 1
        return k * self.oom_factor

    def check_scale(self, workers: int) -> None:
        """The master calls this on a scale request: the global batch must split evenly."""
        if self.global_batch % workers:
            raise ValueError(f"the global batch of {self.global_batch} rows does not split over {workers} workers")
        rows = self.global_batch // workers
        if rows % self.accumulation(workers):
            raise ValueError(f"{workers} workers x {self.accumulation(workers)} micro-batches do not divide the "
                             f"global batch of {self.global_batch} rows")

    # ---- internals -----------------------------------------------------------------------
    def _watch(self, handle: Any, deadline: float | None, base: int) -> tuple[int | None, str | None]:
        """(exit code, why the group was killed as hung or None)."""
        while True:
            code = self.backend.wait(handle, timeout=self.poll_s, check=False)
            if code is not None:
                return code, None
            if self.master.queue.finished and self.master.pending_scale is not None:
                self.master.take_scale()  # nothing left to rescale for
            if self._stopping() is not None:
                self.backend.stop(handle)
                return getattr(handle, "exit_code", None), None
            age = self.master.progress_age()
            joined = any(st.generation >= base for st in list(self.master.workers.values()))
            limit = self.failover.hang_timeout_s if joined else self.failover.startup_timeout_s
            if joined and self.master.queue.finished:  # every row trained: the final save is no training progress
                limit = max(limit, self.failover.startup_timeout_s)
            if age > limit:
                why = (f"no training progress for {age:.0f}s (hang timeout {limit:.0f}s)" if joined else
                       f"no worker joined the master within {age:.0f}s of the launch (startup timeout {limit:.0f}s)")
                log.warning("%s: killing the worker group", why)
                self.backend.stop(handle)
                return getattr(handle, "exit_code", None), why
            if deadline is not None and time.monotonic() > deadline:
                self.backend.stop(handle)
                tail = self.backend.log_tail(handle)
                raise JobFailedError(
                    f"training job timed out after {self.timeout_s}s and was stopped\n--- last lines ---\n{tail}",
                    exit_code=None, log_path=getattr(handle, "log_path", None), log_tail=tail,
                )
            self._maybe_scale(handle)
            if self._relaunch_now is not None:
                self.backend.stop(handle)
                return getattr(handle, "exit_code", None), None

    def _maybe_scale(self, handle: Any) -> None:
        if self.scaler is None or self.master.pending_scale is not None or self.master.queue.finished:
            return
        want = self.scaler({**self.master.state(), "launch": self._launch_info(handle)}, self.plan)
        decision = Rescale(workers=int(want)) if isinstance(want, int) else want
        if decision is None or not decision.changes(self.plan):
            return
        k = self.accumulation(decision.workers) * decision.grad_accumulation_factor
        if decision.grad_accumulation_factor != 1 and (self.global_batch // decision.workers) % k:
            decision.report(False, f"{k} micro-batches do not divide the {self.global_batch // decision.workers} rows "
                                   f"a rank trains per step")
            return
        if decision.immediate:
            self._relaunch_now = decision
            return
        try:
            self.master.request_scale(decision.workers, reason=decision.reason)
        except MasterRejection as e:
            log.warning("scaler asked for %s worker(s): rejected: %s", decision.workers, e)
            decision.report(False, f"rejected by the job master: {e}")
            return
        self._decision = decision

    def _decision_for(self, scale: dict[str, Any]) -> Rescale:
        """The scaler's decision behind a pending scale request, or a plain one (a POST /scale)."""
        decision, self._decision = self._decision, None
        if decision is not None and decision.workers == int(scale["workers"]):
            return decision
        if decision is not None:
            decision.report(False, f"superseded by a scale request to {scale['workers']} worker(s)")
        return Rescale(workers=int(scale["workers"]), reason=scale.get("reason") or "scale request")

    def _drop_decision(self, why: str) -> None:
        if self._decision is not None:
            self._decision.report(False, why)
            self._decision = None

    def _apply(self, decision: Rescale, reason: str) -> str:
        """Make `decision` the next launch's plan; returns what changed, for the attempt record."""
        after = decision.plan_after(self.plan)
        parts = [f"{self.plan.workers} -> {after.workers} worker(s)"]
        if after.threads_per_worker != self.plan.threads_per_worker:
            parts.append(f"{self.plan.threads_per_worker} -> {after.threads_per_worker} thread(s) each")
        if decision.grad_accumulation_factor != 1:
            self.oom_factor *= decision.grad_accumulation_factor
            parts.append(f"x{decision.grad_accumulation_factor} gradient accumulation")
        if decision.memory_factor is not None:
            if hasattr(self.backend, "grow_memory"):
                parts.append(f"pod memory {self.backend.grow_memory(decision.memory_factor)}")
            else:
                parts.append("more memory asked for, but this backend sets none")
        self.plan = after
        text = f"{'relaunch now' if decision.immediate else 'rescale'} {', '.join(parts)}: {reason}"
        log.warning("%s", text)
        decision.report(True, text)
        return text

    def _terminated(self, handle: Any, code: int | None, hang: str | None) -> str | None:
        """Why the group exited, when a termination signal from outside the job ended it (the backend's
        `terminated_by`; a hang kill and a clean exit are not)."""
        fn = getattr(self.backend, "terminated_by", None)
        if fn is None or code == 0 or hang is not None:
            return None
        why = fn(handle)
        return None if why is None else f"{why} (exit code {code})"

    def _record(self, attempt: Attempt) -> None:
        if self.on_attempt is not None:
            try:
                self.on_attempt(attempt)
            except Exception as e:  # a record must never take the job down
                log.warning("recording the launch failed: %r", e)

    def _launch_info(self, handle: Any) -> dict[str, Any]:
        """What the backend can tell about the running group (empty where it cannot)."""
        info: dict[str, Any] = {"elapsed_s": time.monotonic() - self._launched_at,
                                "grad_accumulation": self.grad_accumulation, "pending_s": 0.0, "worker_memory": []}
        for key in ("pending_s", "worker_memory"):
            fn = getattr(self.backend, key, None)
            if fn is not None:
                try:
                    info[key] = fn(handle)
                except Exception as e:  # a probe must never take the job down
                    log.debug("backend %s failed: %r", key, e)
        return info

    def _result(self, code: int) -> SupervisorResult:
        return SupervisorResult(exit_code=code, plan=self.plan, handle=self.handle, attempts=self.attempts,
                                restarts=self.restarts, grad_accumulation=self.grad_accumulation)

    def _give_up(self, reason: str, code: int | None, handle: Any) -> JobFailedError:
        s = self.master.state()
        progress = (f"progress kept: master at epoch {s['epoch']} of {s['epochs']}, {s['rows_done_total']} row(s) "
                    f"done; the checkpoints and the master state stay for a resumed run")
        tail = self.backend.log_tail(handle)
        log_path = getattr(handle, "log_path", None)
        err = JobFailedError(f"training job failed: {reason}\n{progress}\nlog: {log_path}\n--- last lines ---\n{tail}",
                             exit_code=code, log_path=log_path, log_tail=tail)
        err.attempts = [asdict(a) for a in self.attempts]  # type: ignore[attr-defined]
        log.error("training job failed: %s; %s", reason, progress)
        return err
