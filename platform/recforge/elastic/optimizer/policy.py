"""DLRover-RM's three-stage resource optimizer behind the `elastic.Policy` seam: `plan(job)` is stage 1
(warm_start.py); `runtime()` and `instability()` give the stage 2 and 3 objects for the same job
(runtime_stage.py, instability_stage.py). Every decision is an `Event`; nothing here executes a plan
(recforge.elastic.master.dlrover_scaler does)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from recforge.elastic.optimizer.errors import RECORD_ERRORS, describe
from recforge.elastic.optimizer.events import Event
from recforge.elastic.optimizer.instability_stage import InstabilityStage
from recforge.elastic.optimizer.models.history import History
from recforge.elastic.optimizer.models.memory_model import DEFAULT_MEMORY_MODEL, MemoryModel
from recforge.elastic.optimizer.models.throughput_model import ThroughputModel
from recforge.elastic.optimizer.plans import JobDescription, JobLimits, OptimizerConfig, PodPlan
from recforge.elastic.optimizer.runtime_stage import RuntimeStage
from recforge.elastic.optimizer.warm_start import WarmStart, history_memory_points, warm_start
from recforge.elastic.policy import JobInfo, ResourcePlan

MAX_MEMORY_POINTS = 2000  # history points carried from stage 1 to the train task's fit


class DLRoverPolicy:
    """`plan(job)` is stage 1; `runtime()` / `instability()` give the stage 2 and 3 objects for the
    same job; every decision is appended to `events`.

    JobInfo.extra may carry: dataset, model_family, batch_size, table_bytes (list), total_samples,
    memory_per_worker, host_cores, limits (a JobLimits or dict)."""

    def __init__(self, history: History | None = None, limits: JobLimits | None = None,
                 config: OptimizerConfig = OptimizerConfig(), default_model: ThroughputModel | None = None,
                 default_memory: MemoryModel | None = None) -> None:
        self.history = history
        self.limits = limits
        self.config = config
        self.default_model = default_model
        self.default_memory = default_memory
        self.stage1: dict[str, Any] = {}  # the stage 1 state this policy was restored from (from_stage1)
        self.events: list[Event] = []
        self.warm: WarmStart | None = None
        self.job: JobDescription | None = None
        self._restored = False

    @classmethod
    def from_stage1(cls, state: Mapping[str, Any], config: OptimizerConfig = OptimizerConfig()) -> DLRoverPolicy:
        """The policy as the plan task left it (`stage1_state()`, JSON): `plan()` returns
        that plan without running stage 1 again. A state that cannot be read raises ValueError naming
        what is wrong (callers fall back to the plan without stages 2/3)."""
        try:
            j = state["job"]
            plan = PodPlan.from_dict(state["plan"])
            limits = JobLimits(**state["limits"])
            prior = ThroughputModel.from_dict(state["prior"]) if state.get("prior") else None
            memory = MemoryModel.from_dict(state["memory"]) if state.get("memory") else DEFAULT_MEMORY_MODEL
            job = JobDescription(str(j["dataset"]), str(j["model_family"]), plan,
                                 total_samples=float(j["total_samples"]),
                                 table_bytes=[float(b) for b in state.get("table_bytes") or []],
                                 host_cores=None if j.get("host_cores") is None else float(j["host_cores"]))
        except RECORD_ERRORS as e:
            raise ValueError(f"DLRover stage 1 state unreadable ({describe(e)})") from e
        limits.check()
        policy = cls(limits=limits, config=config, default_model=prior)
        policy.job, policy.warm, policy._restored = job, WarmStart(plan, [], prior, memory), True
        policy.warm.memory_note = str(state.get("memory_source", ""))
        policy.stage1 = dict(state)
        return policy

    def stage1_state(self) -> dict[str, Any]:
        """Stage 1's outcome as JSON-able data, what `from_stage1` restores the policy from."""
        job, limits, w = self._need_plan()
        return {"job": {"dataset": job.dataset, "model_family": job.model_family, "total_samples": job.total_samples,
                        "host_cores": job.host_cores, "batch_size": job.requested.batch_size},
                "limits": dict(limits.__dict__), "plan": w.plan.to_dict(),
                "prior": w.prior.to_dict() if w.prior is not None else None, "memory": w.memory.to_dict(),
                "memory_source": w.memory_note, "table_bytes": list(job.table_bytes),
                # earlier runs' measured peaks: the train task fits this run's memory model on them and its own
                "memory_points": [s.to_dict() for s in history_memory_points(w.records)][:MAX_MEMORY_POINTS]}

    def describe(self, job: JobInfo) -> tuple[JobDescription, JobLimits]:
        x = dict(job.extra or {})
        r = job.resources
        batch = int(x.get("batch_size", max(1, job.rows_per_task)))
        requested = PodPlan(workers=r.workers, cpu_per_worker=float(r.threads_per_worker),
                            memory_per_worker=float(x.get("memory_per_worker", self.config.default_worker_memory)),
                            batch_size=batch)
        limits = x.get("limits", self.limits)
        if isinstance(limits, Mapping):
            limits = JobLimits(**limits)
        if limits is None:
            limits = JobLimits.of_this_machine()
        host = x.get("host_cores", float(os.cpu_count() or 1) if job.resources.backend == "local" else None)
        desc = JobDescription(dataset=str(x.get("dataset", "unknown")),
                              model_family=str(x.get("model_family", "unknown")), requested=requested,
                              total_samples=float(x.get("total_samples", job.total_rows)),
                              table_bytes=list(x.get("table_bytes", ())), host_cores=host)
        return desc, limits

    def plan(self, job: JobInfo) -> ResourcePlan:
        if self._restored and self.warm is not None:
            return self.warm.plan.to_resource_plan()
        desc, limits = self.describe(job)
        self.job, self.limits = desc, limits
        self.warm = warm_start(desc, self.history, limits, self.config, self.default_model, self.default_memory)
        self.events.extend(self.warm.events)
        return self.warm.plan.to_resource_plan()

    def runtime(self) -> RuntimeStage:
        job, limits, w = self._need_plan()
        return RuntimeStage(job, limits, self.config, w.prior, w.memory, terms=w.prior.terms if w.prior else None)

    def instability(self) -> InstabilityStage:
        job, limits, w = self._need_plan()
        return InstabilityStage(job, limits, self.config, w.memory)

    def _need_plan(self) -> tuple[JobDescription, JobLimits, WarmStart]:
        """The job, its limits and stage 1's outcome; plan() (or from_stage1) sets all three."""
        if self.warm is None or self.job is None or self.limits is None:
            raise RuntimeError("DLRoverPolicy: call plan(job) (stage 1) first")
        return self.job, self.limits, self.warm
