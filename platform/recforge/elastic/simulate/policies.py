"""The policies the simulator compares; each sees only what a job's profiler would report.

- `static`: the user's request, never changed; an OOM or eviction restarts the job with the same plan.
- `optimus`: Optimus-style, stage 2 only: an online NNLS model of the job (from a generic prior, refit
  on the job's own samples) and greedy marginal-gain scaling; no warm start, no instability handling.
- `dlrover`: DLRover-RM: stage 1 from the history of the job's scenario (filled as jobs finish), stage 2
  as above but from the warm-start model, stage 3 (stragglers, hot servers, memory, pending), and
  elastic failover (an evicted pod is relaunched alone, without restarting the job).
All use the real `recforge.elastic.optimizer` code.
"""
from __future__ import annotations

from dataclasses import replace

from recforge.elastic.optimizer import (
    PS_TERMS,
    Event,
    InMemoryHistory,
    InstabilityStage,
    JobDescription,
    JobLimits,
    JobRecord,
    Observation,
    OptimizerConfig,
    PodPlan,
    RuntimeStage,
    ThroughputModel,
    warm_start,
)

GiB = float(1 << 30)

# A generic prior for PS jobs: an engineer's guess of a "typical DLRM", deliberately not the truth
# (each coefficient is 0.5x-2x off the trace's base values).
GENERIC_PRIOR = ThroughputModel(PS_TERMS, (0.04, 2e-4, 1e-4, 0.001, 0.002, 0.001), meta={"source": "generic prior"})


class SimPolicy:
    name = "base"
    elastic_failover = False

    def initial_plan(self, job, desc: JobDescription, limits: JobLimits) -> tuple[PodPlan, list[Event]]:
        return desc.requested, []

    def on_tick(self, job, obs: Observation) -> list[Event]:
        return []

    def on_oom(self, job, obs: Observation) -> list[Event]:
        return []

    def on_pending(self, job, obs: Observation) -> list[Event]:
        return []

    def on_finish(self, job, plan: PodPlan, state) -> None:
        pass


class StaticPolicySim(SimPolicy):
    name = "static"


class OptimusPolicySim(SimPolicy):
    name = "optimus"

    def __init__(self, config: OptimizerConfig = OptimizerConfig()) -> None:
        self.config = replace(config, rightsize=False)  # Optimus only follows its throughput model
        self.stages: dict[int, RuntimeStage] = {}

    def initial_plan(self, job, desc, limits):
        self.stages[job.job_id] = RuntimeStage(desc, limits, self.config, GENERIC_PRIOR)
        return desc.requested, []

    def on_tick(self, job, obs):
        return self.stages[job.job_id].observe(obs)

    def on_finish(self, job, plan, state):
        self.stages.pop(job.job_id, None)


class DLRoverPolicySim(SimPolicy):
    name = "dlrover"
    elastic_failover = True

    def __init__(self, config: OptimizerConfig = OptimizerConfig(), warm: bool = True, instability: bool = True,
                 failover: bool = True) -> None:
        self.config = config
        self.history = InMemoryHistory()
        self.warm, self.instability, self.elastic_failover = warm, instability, failover
        self.runtime: dict[int, RuntimeStage] = {}
        self.stage3: dict[int, InstabilityStage] = {}
        if not (warm and instability and failover):
            self.name = "dlrover" + "".join(s for s, on in (("-nowarm", warm), ("-nostage3", instability),
                                                             ("-nofailover", failover)) if not on)

    def initial_plan(self, job, desc, limits):
        ws = warm_start(desc, self.history if self.warm else None, limits, self.config, GENERIC_PRIOR)
        for e in ws.events:
            e.time_s = job.arrival_s
        self.runtime[job.job_id] = RuntimeStage(desc, limits, self.config, ws.prior or GENERIC_PRIOR, None)
        self.stage3[job.job_id] = InstabilityStage(desc, limits, self.config, None)
        return ws.plan, ws.events

    def on_tick(self, job, obs):
        events = self.stage3[job.job_id].observe(obs) if self.instability else []
        if any(e.changes_plan for e in events):
            return events
        return events + self.runtime[job.job_id].observe(obs)

    def on_oom(self, job, obs):
        return self.stage3[job.job_id].observe(obs) if self.instability else []

    def on_pending(self, job, obs):
        return self.stage3[job.job_id].observe(obs) if self.instability else []

    def on_finish(self, job, plan, state):
        rt = self.runtime.pop(job.job_id, None)
        self.stage3.pop(job.job_id, None)
        # the job's own model once it saw its own samples (fitted, or the prior rescaled to them)
        model = rt.model.model if rt is not None and rt.model.samples else None
        self.history.add(JobRecord(dataset=job.scenario, model_family=job.family, final_plan=plan.to_dict(),
                                   samples_per_s=state.get("rate"), model=model,
                                   peak_memory_bytes=state.get("peak_worker_mem"), finished_at=state["time"],
                                   extra={"peak_server_memory": state.get("peak_server_mem")}))


def make_policy(name: str, config: OptimizerConfig = OptimizerConfig()) -> SimPolicy:
    if name == "static":
        return StaticPolicySim()
    if name == "optimus":
        return OptimusPolicySim(config)
    if name == "dlrover":
        return DLRoverPolicySim(config)
    if name.startswith("dlrover-"):
        flags = set(name.split("-")[1:])
        unknown = flags - {"nowarm", "nostage3", "nofailover"}
        if unknown:
            raise ValueError(f"unknown dlrover variant flags {sorted(unknown)}")
        return DLRoverPolicySim(config, warm="nowarm" not in flags, instability="nostage3" not in flags,
                                failover="nofailover" not in flags)
    raise ValueError(f"unknown policy {name!r}; "
                     "choose static, optimus, dlrover (or dlrover-nowarm/-nostage3/-nofailover)")
