"""DLRover-RM stage 2 (recforge.elastic.optimizer.RuntimeStage) executing its plans through rescales.

A `Scaler` for run_training_job's supervisor: every poll it turns the job master's state into an
`Observation` (throughput from the rows done since the last call, the plan the group runs), feeds
the runtime stage and, when an event changes the number of workers, returns it; the supervisor asks
the master to rescale (the group checkpoints and stops, the job relaunches at the new size, the
checkpoint is loaded resharded). Such events are marked `executed`. Only the worker count is
executed: CPU per worker and parameter servers stay recommendations (logged with the events).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from recforge.elastic.events import Event
from recforge.elastic.optimizer import DLRoverPolicy, JobPlan, Observation
from recforge.elastic.policy import ResourcePlan


class DLRoverScaler:
    def __init__(self, policy: DLRoverPolicy, *, min_interval_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        if policy.warm is None:
            raise RuntimeError("DLRoverScaler: the policy has no plan yet; call policy.plan(job) (stage 1) first")
        self.policy, self.clock, self.min_interval_s = policy, clock, min_interval_s
        self.runtime = policy.runtime()
        self.plan: JobPlan = policy.warm.plan
        self.events: list[Event] = []
        self._last: tuple[float, int] | None = None

    def __call__(self, state: dict[str, Any], running: ResourcePlan) -> int | None:
        now = self.clock()
        rows = int(state["rows_done_total"])
        if self._last is not None and now - self._last[0] < self.min_interval_s:
            return None
        sps = None
        if self._last is not None and now > self._last[0] and rows >= self._last[1]:
            sps = (rows - self._last[1]) / (now - self._last[0])
        self._last = (now, rows)
        if running.workers != self.plan.workers:  # the group runs another size than we think (rescaled)
            self.plan = JobPlan(**{**self.plan.to_dict(), "workers": running.workers})
        obs = Observation(time_s=now, plan=self.plan, samples_per_s=sps,
                          step=rows // max(1, self.plan.batch_size))
        events = self.runtime.observe(obs)
        self.events.extend(events)
        for e in events:
            if e.changes_plan and e.plan_after is not None:
                new = JobPlan.from_dict(e.plan_after)
                if new.workers != self.plan.workers:
                    e.executed = True
                    self.plan = new
                    return new.workers
        return None
