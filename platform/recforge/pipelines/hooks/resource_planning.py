"""DLRover-RM in the daily pipeline (resources.policy == "dlrover"): stage 1 in the plan task, stages 2/3
during the train task (recforge.pipelines.hooks.dlrover_training), everything logged to the tasks' MLflow runs,
and the run's resource model kept as history for tomorrow's stage 1."""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from recforge.elastic.master.dlrover_scaler import DLRoverScaler
from recforge.elastic.optimizer import (
    DLRoverPolicy,
    Event,
    GiB,
    History,
    InstabilityStage,
    JobDescription,
    JobLimits,
    MemoryModel,
    ModelFitError,
    Observation,
    OptimizerConfig,
    PodPlan,
    ResourceLimitError,
    RuntimeStage,
    Sample,
    ThroughputModel,
    local_default_model,
    optimizer_config,
)
from recforge.elastic.optimizer.models.resource_store import MlflowHistory, log_resource_model
from recforge.elastic.policy import JobInfo, ResourcePlan
from recforge.tracking.resource_models import log_events
from recforge.tracking.store import TrackingStore

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# the plan task: stage 1
# ---------------------------------------------------------------------------------------------
def plan_with_dlrover(store: TrackingStore, run_id: str, cfg, tables,
                      total_rows: int) -> tuple[ResourcePlan, dict[str, Any]]:
    """Stage 1 for the plan task: MLflow history of runs with the same dataset preset and model family,
    within cfg.resources.dlrover's limits. Logs the events and the stage's state; returns
    (ResourcePlan, state for the train task)."""
    dl = cfg.resources.dlrover
    history = MlflowHistory(store)
    out = pipeline_plan(cfg.resources, dataset=cfg.dataset_preset, model_family=cfg.model.arch,
                        batch_size=cfg.train.batch_size, total_rows=int(total_rows), tables=tables,
                        embedding_dim=cfg.model.embedding_dim, history=history,
                        limits=pipeline_limits(dl.max_cpu, dl.max_workers),
                        memory_per_worker=dl.worker_memory_gib * GiB if dl.worker_memory_gib else None,
                        config=optimizer_config(dl), epochs=cfg.train.epochs)
    log_events(store, run_id, out["events"])
    store.log_dict(run_id, {**out["state"], "history_problems": history.problems}, "resource_model/stage1.json")
    store.set_tags(run_id, {"dlrover.stage1": out["events"][0].action if out["events"] else "none"})
    return ResourcePlan(out["workers"], out["threads_per_worker"]), out["state"]


def table_bytes(tables: Sequence[Sequence], embedding_dim: int, bytes_per_value: int = 4) -> list[float]:
    """Weight bytes of each embedding table [(name, rows), ...]."""
    return [float(int(rows) * embedding_dim * bytes_per_value) for _, rows in tables]


def pipeline_limits(max_cpu: float | None = None, max_workers: int | None = None) -> JobLimits:
    """This machine's limits, narrowed by the pipeline's resources.dlrover settings; limits that cannot
    hold one worker raise ResourceLimitError naming the setting."""
    machine = JobLimits.of_this_machine()
    cpu = float(max_cpu) if max_cpu is not None else machine.cpu
    limits = replace(machine, cpu=cpu, max_cpu_per_worker=max(1.0, min(machine.max_cpu_per_worker, cpu)),
                     max_workers=int(max_workers) if max_workers is not None else machine.max_workers)
    try:
        limits.check()
    except ResourceLimitError as e:
        raise ResourceLimitError(f"resources.dlrover (max_cpu={max_cpu}, max_workers={max_workers}): {e}") from e
    return limits


def pipeline_plan(resources, *, dataset: str, model_family: str, batch_size: int, total_rows: int,
                  tables: Sequence[Sequence], embedding_dim: int, history: History | None,
                  limits: JobLimits | None = None, memory_per_worker: float | None = None,
                  config: OptimizerConfig = OptimizerConfig(), epochs: int = 1) -> dict[str, Any]:
    """Stage 1 for one training job of the daily pipeline: the plan, its events, and the state the
    train task runs stages 2/3 from (JSON-able; `DLRoverPolicy.from_stage1`)."""
    policy = DLRoverPolicy(history, limits, config=config, default_model=local_default_model())
    extra = {"dataset": dataset, "model_family": model_family, "batch_size": batch_size,
             "table_bytes": table_bytes(tables, embedding_dim), "total_samples": float(total_rows) * epochs}
    if memory_per_worker is not None:
        extra["memory_per_worker"] = float(memory_per_worker)
    info = JobInfo(shard_rows=[int(total_rows)], epochs=epochs, rows_per_task=batch_size, resources=resources,
                   extra=extra)
    rp = policy.plan(info)
    return {"workers": rp.workers, "threads_per_worker": rp.threads_per_worker, "events": policy.events,
            "state": policy.stage1_state()}


# ---------------------------------------------------------------------------------------------
# the train task: stages 2/3 as the elastic runtime executed them
# ---------------------------------------------------------------------------------------------
def log_dlrover_run(store: TrackingStore, run_id: str, scaler: DLRoverScaler,
                    attempts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stages 2/3 as the elastic runtime executed them during the train task (`DLRoverScaler`): every
    event (executed or not, with why), the throughput measured at each plan, the relaunches, and this
    run's model with its measured points as history for tomorrow's stage 1 (registered, so it can be
    browsed and loaded by name)."""
    events = list(scaler.events)
    log_events(store, run_id, events)
    executed = [e for e in events if e.executed]
    by_plan = scaler.throughput_by_plan()
    metrics: dict[str, float] = {
        "dlrover.decisions": float(sum(1 for e in events if e.changes_plan or e.action == "replace_straggler")),
        "dlrover.executed": float(len(executed)),
        "dlrover.relaunches": float(sum(1 for a in attempts if a.get("outcome") == "rescaled")),
        "dlrover.final_workers": float(scaler.plan.workers),
    }
    for p in by_plan:
        metrics[f"dlrover.samples_per_s.w{p['workers']}t{p['threads_per_worker']}"] = p["samples_per_s"]
    if len(by_plan) >= 2 and by_plan[0]["samples_per_s"] > 0:
        metrics["dlrover.throughput_ratio_last_vs_first_plan"] = (by_plan[-1]["samples_per_s"]
                                                                  / by_plan[0]["samples_per_s"])
    store.log_metrics(run_id, metrics)
    for i, m in enumerate(scaler.measured):  # the run's timeline, one point per profiler poll
        store.log_metrics(run_id, {"dlrover.samples_per_s": m["samples_per_s"],
                                   "dlrover.workers": float(m["workers"])}, step=i)
    summary: dict[str, Any] = {"executed": [e.to_dict() for e in executed], "throughput_by_plan": by_plan,
                               "attempts": list(attempts), "final_plan": scaler.plan.to_dict(),
                               "events": len(events), "model_status": scaler.runtime.model.status}
    summary["model_uri"] = _log_run_model(store, run_id, scaler, by_plan)
    store.log_dict(run_id, summary, "resource_model/stage23.json")
    return summary


def _log_run_model(store: TrackingStore, run_id: str, scaler: DLRoverScaler,
                   by_plan: list[dict[str, Any]]) -> str | None:
    """The runtime stage's model after the run, fitted (or the prior rescaled) on what the run measured."""
    online, job, warm = scaler.runtime.model, scaler.policy.job, scaler.policy.warm
    if job is None or warm is None:  # a DLRoverScaler is only built on a policy that ran stage 1
        raise RuntimeError("DLRoverPolicy: call plan(job) (stage 1) first")
    if not online.samples:
        log.warning("DLRover: the run measured no throughput; no resource model logged for the history")
        return None
    try:
        online.refit()
    except ModelFitError as e:  # keep what the stage used; say so
        online.status = f"final refit failed ({e}); model as used during the run"
    if online.model is None:
        log.warning("DLRover: no resource model after the run (%s); none logged", online.status)
        return None
    points = [Sample(replace(scaler.plan, workers=p["workers"], cpu_per_worker=float(p["threads_per_worker"]))
                     .allocation(job.host_cores), float(p["samples_per_s"])) for p in by_plan]
    return log_resource_model(
        store, run_id, model=online.model, dataset=job.dataset, model_family=job.model_family,
        final_plan=scaler.plan.to_dict(), memory=warm.memory, samples_per_s=by_plan[-1]["samples_per_s"],
        points=points, extra={"points": [{"allocation": s.allocation.to_dict(), "samples_per_s": s.samples_per_s}
                                         for s in points], "model_status": online.status}, register=True)


# ---------------------------------------------------------------------------------------------
# stages 2/3 as recommendations on a finished run's measurements
# ---------------------------------------------------------------------------------------------
def recommend_after_run(state: Mapping[str, Any], worker_result: Mapping[str, Any],
                        per_worker_samples: Mapping[str, float] | None = None,
                        cfg: OptimizerConfig = OptimizerConfig(),
                        ) -> tuple[list[Event], ThroughputModel | None, PodPlan]:
    """Stages 2 and 3 on what a finished run measured (its throughput, and each worker's share of the
    samples from the job master). The run is one long profile, so stage 2 needs one sample and no
    pacing here. Returns the events (recommendations: nothing executes them), the job's model (the
    prior rescaled to the measurement, for the history) and the plan that ran."""
    j = state["job"]
    ran = replace(PodPlan.from_dict(state["plan"]),
                  workers=int(worker_result.get("world_size", state["plan"]["workers"])),
                  cpu_per_worker=float(worker_result.get("threads_per_worker", state["plan"]["cpu_per_worker"])),
                  batch_size=int(worker_result.get("batch_size", j["batch_size"])))
    limits = JobLimits(**state["limits"])
    desc = JobDescription(j["dataset"], j["model_family"], ran, total_samples=float(j["total_samples"]),
                          table_bytes=list(state.get("table_bytes") or []), host_cores=j.get("host_cores"))
    try:
        prior = ThroughputModel.from_dict(state["prior"]) if state.get("prior") else None
        memory = MemoryModel.from_dict(state["memory"]) if state.get("memory") else None
    except Exception as e:
        prior, memory = None, None
        log.warning("stage 1 state unreadable (%r): recommending without a prior", e)
    thr = float(worker_result.get("samples_per_s") or 0.0)
    shares = [float(v) for v in (per_worker_samples or {}).values() if v is not None]
    # in one wall time a worker's step time is inversely proportional to the samples it got through
    steps = [1.0 / v if v > 0 else math.inf for v in shares] if len(shares) >= 2 else []
    obs = Observation(time_s=float(worker_result.get("wall_s", 0.0)), plan=ran, samples_per_s=thr if thr > 0 else None,
                      step=int(worker_result.get("steps", 0)) * ran.workers, worker_step_s=steps,
                      total_steps=float(j["total_samples"]) / max(ran.batch_size, 1))
    events: list[Event] = []
    stage3 = InstabilityStage(desc, limits, cfg, memory)
    try:
        events += stage3.observe(obs)
    except Exception as e:  # never crash the train task over a recommendation
        events.append(Event("instability", "fallback", f"stage 3 failed ({e!r})", plan_before=ran.to_dict()))
    rt = RuntimeStage(desc, limits, replace(cfg, profile_samples=1, interval_s=0.0), prior, memory)
    try:
        events += rt.observe(obs)
    except Exception as e:
        events.append(Event("runtime", "fallback", f"stage 2 failed ({e!r})", plan_before=ran.to_dict()))
    if thr <= 0:
        events.append(Event("runtime", "fallback", "the run reported no throughput: no model update",
                            plan_before=ran.to_dict()))
    for ev in events:
        ev.reason += " [recommendation: not executed; the elastic runtime that applies plans is a separate issue]"
    return events, rt.model.model if rt.model.samples else None, ran
