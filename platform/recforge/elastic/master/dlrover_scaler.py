"""DLRover-RM stages 2 and 3 (recforge.elastic.optimizer) executed through the supervisor's rescales.

A `Scaler` for run_training_job's supervisor: every poll it builds an `Observation` from the job master's state
and the backend, asks stage 3 (`InstabilityStage`), then stage 2 (`RuntimeStage`), and turns the first executable
decision into a `supervisor.Rescale`; decisions about parameter servers are logged as "not executed". Design and
which decision becomes which relaunch: docs/fault_tolerance.md#dlrover-rm-decisions-while-the-job-runs.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from recforge.elastic.master.supervisor import Rescale
from recforge.elastic.optimizer.errors import MODEL_ERRORS
from recforge.elastic.optimizer.events import Event
from recforge.elastic.optimizer.observation import Observation
from recforge.elastic.optimizer.plans import PodPlan, optimizer_config
from recforge.elastic.optimizer.policy import DLRoverPolicy
from recforge.elastic.policy import ResourcePlan

log = logging.getLogger(__name__)

NOT_EXECUTABLE = {
    "migrate_hot_server": "the trainer has no parameter servers (TorchRec shards embeddings over the workers)",
    "rebalance_hot_shard": "resharding a hot embedding shard is left to the TorchRec planner at the next launch",
    "relaunch_servers_more_memory": "the trainer has no parameter servers",
    "memory_at_limit": "the pod is at the memory cap",
}


class DLRoverScaler:
    def __init__(self, policy: DLRoverPolicy, *, min_interval_s: float = 5.0, memory_action: str = "accumulate",
                 max_grad_accumulation: int = 8, clock: Callable[[], float] = time.time) -> None:
        """`memory_action`: "accumulate" (local) or "more_memory" (a backend with grow_memory)."""
        if policy.warm is None:
            raise RuntimeError("DLRoverScaler: the policy has no plan yet; call policy.plan(job) (stage 1) first")
        if memory_action not in ("accumulate", "more_memory"):
            raise ValueError(f"memory_action must be 'accumulate' or 'more_memory', got {memory_action!r}")
        self.policy, self.clock, self.min_interval_s = policy, clock, min_interval_s
        self.memory_action, self.max_grad_accumulation = memory_action, max_grad_accumulation
        self.runtime = policy.runtime()
        self.instability = policy.instability()
        self.plan: PodPlan = policy.warm.plan
        self.events: list[Event] = []
        self.measured: list[dict[str, Any]] = []  # one per poll with throughput: plan and samples/s
        self._last: tuple[float, int] | None = None
        self._first_seen: dict[str, tuple[float, int]] = {}  # worker id -> (time, its samples) when first seen
        self._last_executed_s: float | None = None
        self._training_polls = 0
        self._rates: list[float] = []  # rows/s of the last three poll windows
        self._skipped: set[tuple[str, str]] = set()  # (action, why) already logged as not executed
        self._repeats: set[int] = set()  # ids of events that only repeat such a skip (not logged again)

    # ---- the Scaler protocol ----------------------------------------------------------------
    def __call__(self, state: dict[str, Any], running: ResourcePlan) -> Rescale | None:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.min_interval_s:
            return None
        self._repeats.clear()
        rows = int(state["rows_done_total"])
        rate = None
        if self._last is not None and now > self._last[0] and rows >= self._last[1]:
            rate = (rows - self._last[1]) / (now - self._last[0])
        self._last = (now, rows)
        # a window is a throughput sample only when training went on in the windows before and after it:
        # the first and last windows of a group also hold start-up and shut-down time
        self._rates = (self._rates + [rate or 0.0])[-3:]
        sps = self._rates[1] if len(self._rates) == 3 and min(self._rates) > 0 else None
        planned = (self.plan.workers, self.plan.to_resource_plan().threads_per_worker)
        if (running.workers, running.threads_per_worker) != planned:
            self.plan = replace(self.plan, workers=running.workers, cpu_per_worker=float(running.threads_per_worker))
        launch = state.get("launch") or {}
        self._training_polls = self._training_polls + 1 if sps else 0
        obs = Observation(
            time_s=now, plan=self.plan, samples_per_s=sps, step=rows // max(1, self.plan.batch_size),
            worker_step_s=self._step_times(state, now),
            # RSS climbs while a group builds its model and takes its first steps: not a trend to extrapolate
            worker_memory=list(launch.get("worker_memory") or []) if self._training_polls >= 3 else [],
            pending_s=float(launch.get("pending_s") or 0.0),
        )
        if sps:
            self.measured.append({"time_s": now, "workers": self.plan.workers,
                                  "threads_per_worker": running.threads_per_worker, "samples_per_s": sps})
        events = self._run("instability", self.instability.observe, obs)
        decision = self._first_decision(events, launch)
        if decision is None:  # memory is stage 3's: stage 2 right-sizes no pod memory our launchers could not set
            more = self._run("runtime", self.runtime.observe, replace(obs, worker_memory=[]))
            events += more
            decision = self._first_decision(more, launch)
        self.events.extend(e for e in events if id(e) not in self._repeats)
        return decision

    # ---- internals -------------------------------------------------------------------------
    def _run(self, stage: str, fn: Callable[[Observation], list[Event]], obs: Observation) -> list[Event]:
        try:
            return fn(obs)
        except MODEL_ERRORS as e:  # a degenerate model must not take the training job down; a bug propagates
            log.exception("DLRover stage %s failed", stage)
            return [Event(stage, "fallback", f"{stage} stage failed ({type(e).__name__}: {e}); plan kept",
                          plan_before=obs.plan.to_dict(), time_s=obs.time_s)]

    def _step_times(self, state: dict[str, Any], now: float) -> list[float]:
        """Seconds per batch of each worker of the newest group, over the time since it was first seen;
        empty until every one of them has been watched for two poll intervals."""
        workers = state.get("workers") or {}
        if not workers:
            return []
        newest = max(int(w.get("generation", 0)) for w in workers.values())
        group = {wid: int(w.get("samples", 0)) for wid, w in sorted(workers.items())
                 if int(w.get("generation", 0)) == newest}
        seen = {wid: self._first_seen.setdefault(wid, (now, n)) for wid, n in group.items()}
        if len(group) < 2 or any(now - t0 < 2 * self.min_interval_s for t0, _ in seen.values()):
            return []
        rates = [(group[wid] - s0) / (now - t0) for wid, (t0, s0) in seen.items()]
        return [self.plan.batch_size / r if r > 0 else float("inf") for r in rates]

    def _first_decision(self, events: list[Event], launch: dict[str, Any]) -> Rescale | None:
        for e in events:
            decision = self._decision(e, launch)
            if decision is not None:
                return decision
        return None

    def _decision(self, e: Event, launch: dict[str, Any]) -> Rescale | None:
        if e.action == "replace_straggler":
            new = self.plan
        elif not e.changes_plan or e.plan_after is None:
            return None
        else:
            new = PodPlan.from_dict(e.plan_after)
        since = None if self._last_executed_s is None else e.time_s - self._last_executed_s
        if e.action in NOT_EXECUTABLE:
            self._skip(e, NOT_EXECUTABLE[e.action])
            return None
        if since is not None and since < self.policy.config.interval_s and e.action != "relaunch_smaller":  # paced
            self._skip(e, f"paced: the last change was {since:.0f}s ago "
                          f"(< {self.policy.config.interval_s:.0f}s)")
            return None
        settle = self._settler(e, new)
        if e.action == "replace_straggler":
            return Rescale(workers=self.plan.workers, relaunch=True, reason=e.reason, on_applied=settle)
        if e.action == "relaunch_smaller":
            return Rescale(workers=new.workers, threads_per_worker=new.to_resource_plan().threads_per_worker,
                           immediate=True, reason=e.reason, on_applied=settle)
        if e.action == "relaunch_workers_more_memory":
            if self.memory_action == "more_memory":
                factor = new.memory_per_worker / self.plan.memory_per_worker
                return Rescale(workers=self.plan.workers, memory_factor=factor, reason=e.reason, on_applied=settle)
            k = int(launch.get("grad_accumulation") or 1)
            if 2 * k > self.max_grad_accumulation:
                self._skip(e, f"gradient accumulation is at {k}; doubling it would pass "
                              f"max_grad_accumulation={self.max_grad_accumulation}")
                return None
            return Rescale(workers=self.plan.workers, grad_accumulation_factor=2, reason=e.reason, on_applied=settle)
        before, after = self.plan.to_resource_plan(), new.to_resource_plan()
        if (after.workers, after.threads_per_worker) != (before.workers, before.threads_per_worker):
            return Rescale(workers=after.workers, threads_per_worker=after.threads_per_worker, reason=e.reason,
                           on_applied=settle)
        self._skip(e, "only memory or server fields change; the local and Kubernetes launchers set those per "
                      "backend, not per plan")
        return None

    def _settler(self, e: Event, new: PodPlan) -> Callable[[bool, str], None]:
        def settle(applied: bool, note: str) -> None:
            if applied:
                e.executed = True
                e.reason += f" [executed: {note}]"
                self.plan, self._last_executed_s = new, self.clock()
                self._first_seen.clear()
                self._skipped.clear()
                self._rates.clear()
                self.instability.trends.clear()  # new processes: their memory starts a new trend
            else:
                e.reason += f" [not executed: {note}]"
        return settle

    def _skip(self, e: Event, why: str) -> None:
        key = (e.action, why.split(":")[0])
        if key in self._skipped:
            self._repeats.add(id(e))
        self._skipped.add(key)
        e.reason += f" [not executed: {why}]"

    # ---- reporting -------------------------------------------------------------------------
    def throughput_by_plan(self) -> list[dict[str, Any]]:
        """Median measured samples/s per plan, in the order the plans ran."""
        groups: dict[tuple[int, int], list[float]] = {}
        for m in self.measured:
            groups.setdefault((m["workers"], m["threads_per_worker"]), []).append(m["samples_per_s"])
        return [{"workers": w, "threads_per_worker": t, "samples_per_s": statistics.median(v), "polls": len(v)}
                for (w, t), v in groups.items()]


def scaler_from_stage1(state: dict[str, Any], settings: Any = None, *, memory_action: str = "accumulate",
                       clock: Callable[[], float] = time.time) -> DLRoverScaler:
    """The stage 2/3 controller of a pipeline job from the plan task's stage 1 state and the pipeline's
    resources.dlrover settings (recforge.config.DLRoverConfig; None: DLRover's defaults). An unreadable
    state raises ValueError naming the problem."""
    policy = DLRoverPolicy.from_stage1(state, optimizer_config(settings))
    interval = float(settings.profile_interval_s) if settings is not None else 5.0
    return DLRoverScaler(policy, min_interval_s=interval, memory_action=memory_action, clock=clock)
