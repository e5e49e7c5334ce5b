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
    MemorySample,
    ModelFitError,
    Observation,
    OptimizerConfig,
    PodPlan,
    ResourceLimitError,
    RuntimeStage,
    Sample,
    ThroughputModel,
    embedding_bytes_per_rank,
    embedding_shard_bytes,
    fit_or_prior,
    local_default_memory,
    local_default_model,
    local_default_model_problem,
    optimizer_config,
    samples_from_dicts,
)
from recforge.elastic.optimizer.errors import MODEL_ERRORS, RECORD_ERRORS
from recforge.elastic.optimizer.models.resource_store import MlflowHistory, log_resource_model
from recforge.elastic.policy import JobInfo, ResourcePlan
from recforge.tracking.resource_models import log_events
from recforge.tracking.store import TrackingStore
from recforge.train.result import WorkerResult

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
    out = pipeline_plan(cfg.resources, dataset=cfg.dataset_schema, model_family=cfg.model.arch,
                        batch_size=cfg.train.batch_size, total_rows=int(total_rows), tables=tables,
                        embedding_dim=cfg.model.embedding_dim, history=history,
                        limits=pipeline_limits(dl.max_cpu, dl.max_workers),
                        memory_per_worker=dl.worker_memory_gib * GiB if dl.worker_memory_gib else None,
                        config=optimizer_config(dl), epochs=cfg.train.epochs)
    log_events(store, run_id, out["events"])
    store.log_dict(run_id, {**out["state"], "history_problems": history.problems}, "resource_model/stage1.json")
    store.set_tags(run_id, {"dlrover.stage1": out["events"][0].action if out["events"] else "none",
                            "dlrover.memory_model": str(out["state"].get("memory_source", ""))[:5000]})
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
    policy = DLRoverPolicy(history, limits, config=config, default_model=local_default_model(),
                           default_memory=local_default_memory())
    extra = {"dataset": dataset, "model_family": model_family, "batch_size": batch_size,
             "table_bytes": table_bytes(tables, embedding_dim), "total_samples": float(total_rows) * epochs}
    if memory_per_worker is not None:
        extra["memory_per_worker"] = float(memory_per_worker)
    info = JobInfo(shard_rows=[int(total_rows)], epochs=epochs, rows_per_task=batch_size, resources=resources,
                   extra=extra)
    rp = policy.plan(info)
    if local_default_model_problem():  # stage 1 ran without its default (committed) model: say so
        policy.events.insert(0, Event("warm_start", "fallback", f"no default resource model: "
                                      f"{local_default_model_problem()}; a cold start plans from the request",
                                      plan_before=policy.job.requested.to_dict() if policy.job else None))
    # the train task turns the workers' sharding plan into embedding bytes per rank (memory points)
    state = {**policy.stage1_state(), "tables": [[str(n), int(r)] for n, r in tables], "embedding_dim": embedding_dim}
    return {"workers": rp.workers, "threads_per_worker": rp.threads_per_worker, "events": policy.events,
            "state": state}


# ---------------------------------------------------------------------------------------------
# the train task: stages 2/3 as the elastic runtime executed them
# ---------------------------------------------------------------------------------------------
def log_dlrover_run(store: TrackingStore, run_id: str, scaler: DLRoverScaler,
                    attempts: Sequence[dict[str, Any]], worker: WorkerResult | None = None) -> dict[str, Any]:
    """Stages 2/3 as the elastic runtime executed them during the train task (`DLRoverScaler`): every
    event and every decision (executed or not, with why), stage 1's predictions against the throughput
    measured at each plan and the workers' peak memory (`worker`, rank 0's result; None when the job
    failed), and this run's models as history for tomorrow's stage 1 (registered, so they can be
    browsed and loaded by name)."""
    events = list(scaler.events)
    log_events(store, run_id, events)
    decisions = [e for e in events if e.action != "hold"]  # a hold waits (profiling, pacing): not a decision
    executed = [e for e in events if e.executed]
    by_plan = scaler.throughput_by_plan()
    if not by_plan and worker is not None and worker.samples_per_s > 0:
        # too short for the profiler's windows: the workers' own measurement of the plan they finished on
        by_plan = [{"workers": worker.world_size, "threads_per_worker": worker.threads_per_worker,
                    "samples_per_s": worker.samples_per_s, "polls": 0, "source": "worker result"}]
        ran = replace(scaler.plan, workers=worker.world_size, cpu_per_worker=float(worker.threads_per_worker))
        scaler.runtime.model.add(Sample(ran.allocation(scaler.policy.job.host_cores if scaler.policy.job else None),
                                        worker.samples_per_s), refit=False)
    plans = predicted_vs_measured_throughput(scaler, by_plan)
    metrics: dict[str, float] = {
        "dlrover.decisions": float(len(decisions)),
        "dlrover.executed": float(len(executed)),
        "dlrover.relaunches": float(sum(1 for a in attempts if a.get("outcome") == "rescaled")),
        "dlrover.final_workers": float(scaler.plan.workers),
    }
    for p in plans:
        tag = f"w{p['workers']}t{p['threads_per_worker']}"
        metrics[f"dlrover.samples_per_s.{tag}"] = p["measured_samples_per_s"]
        if p["predicted_samples_per_s"] is not None:
            metrics[f"dlrover.predicted_samples_per_s.{tag}"] = p["predicted_samples_per_s"]
            metrics[f"dlrover.throughput_error.{tag}"] = (p["predicted_samples_per_s"] / p["measured_samples_per_s"]
                                                          - 1.0 if p["measured_samples_per_s"] > 0 else float("nan"))
    if len(by_plan) >= 2 and by_plan[0]["samples_per_s"] > 0:
        metrics["dlrover.throughput_ratio_last_vs_first_plan"] = (by_plan[-1]["samples_per_s"]
                                                                  / by_plan[0]["samples_per_s"])
    memory = memory_measurement(scaler, worker, run_id)
    fitted = MemoryModel.from_dict(memory["fitted"])
    if memory["predicted_peak_bytes"] is not None:
        metrics["dlrover.predicted_peak_memory_bytes"] = memory["predicted_peak_bytes"]
    if memory["measured_peak_bytes"]:
        peak = max(memory["measured_peak_bytes"])
        metrics["dlrover.measured_peak_memory_bytes"] = peak
        if memory["predicted_peak_bytes"] is not None:
            metrics["dlrover.memory_error"] = memory["predicted_peak_bytes"] / peak - 1.0
    metrics["dlrover.memory_model.fitted"] = float(fitted.fitted)
    metrics["dlrover.memory_model.loo_mape"] = fitted.loo_mape
    store.log_metrics(run_id, {k: v for k, v in metrics.items() if v == v})
    store.set_tags(run_id, {"dlrover.memory_model": fitted.source[:5000]})
    for i, m in enumerate(scaler.measured):  # the run's timeline, one point per profiler poll
        store.log_metrics(run_id, {"dlrover.samples_per_s": m["samples_per_s"],
                                   "dlrover.workers": float(m["workers"])}, step=i)
    summary: dict[str, Any] = {
        "executed": [decision(e) for e in executed], "decisions": [decision(e) for e in decisions],
        "throughput_by_plan": by_plan, "plans": plans, "memory": memory, "attempts": list(attempts),
        "final_plan": scaler.plan.to_dict(), "events": len(events), "model_status": scaler.runtime.model.status}
    summary["model_uri"] = _log_run_model(store, run_id, scaler, by_plan, fitted, memory)
    store.log_dict(run_id, summary, "resource_model/stage23.json")
    return summary


def decision(e: Event) -> dict[str, Any]:
    """A decision as the train run records it: stage, action, executed or not, the reason."""
    return {"stage": e.stage, "action": e.action, "executed": e.executed, "reason": e.reason,
            "plan_before": e.plan_before, "plan_after": e.plan_after}


def predicted_vs_measured_throughput(scaler: DLRoverScaler, by_plan: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each plan the job ran: samples/s predicted by the model stage 1 planned with, and as measured."""
    prior, job = scaler.policy.warm.prior if scaler.policy.warm else None, scaler.policy.job
    out = []
    for p in by_plan:
        pred = None
        if prior is not None and job is not None:
            plan = replace(scaler.policy.warm.plan if scaler.policy.warm else scaler.plan, workers=int(p["workers"]),
                           cpu_per_worker=float(p["threads_per_worker"]))
            pred = float(prior.predict(plan.allocation(job.host_cores)))
        out.append({"workers": int(p["workers"]), "threads_per_worker": int(p["threads_per_worker"]),
                    "predicted_samples_per_s": pred, "measured_samples_per_s": float(p["samples_per_s"]),
                    "polls": int(p["polls"]), "source": p.get("source", "profiler polls")})
    return out


def memory_points(state: Mapping[str, Any], worker: WorkerResult, run: str) -> list[MemorySample]:
    """This run's measured points: each rank's peak RSS against the embedding bytes it held (from the
    workers' sharding plan and the stage 1 state's tables) and the steps its generation ran."""
    if not worker.peak_rss_bytes:
        return []
    sharding = {t: p.model_dump() if hasattr(p, "model_dump") else dict(p) for t, p in worker.sharding_plan.items()}
    emb = embedding_bytes_per_rank(sharding, state.get("tables") or [], int(state["embedding_dim"]), worker.world_size)
    steps = worker.steps - (worker.resumed_from.step if worker.resumed_from else 0)
    return [MemorySample(emb[r], max(steps, 0), float(rss), run)
            for r, rss in enumerate(worker.peak_rss_bytes[:worker.world_size]) if rss and rss > 0]


def memory_measurement(scaler: DLRoverScaler, worker: WorkerResult | None, run_id: str) -> dict[str, Any]:
    """Stage 1's memory prediction for the final plan against the workers' measured peaks, and this run's
    memory model: fitted on the earlier runs' points (carried in the stage 1 state) and this run's, or
    the prior with the reason when there are too few."""
    warm, job = scaler.policy.warm, scaler.policy.job
    if warm is None or job is None:
        raise RuntimeError("DLRoverPolicy: call plan(job) (stage 1) first")
    state = scaler.policy.stage1
    history = samples_from_dicts(state.get("memory_points") or [])
    mine: list[MemorySample] = []
    problem = None
    if worker is not None:
        try:
            mine = memory_points(state, worker, run=run_id)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # e.g. a stage 1 state without tables
            problem = f"this run's peaks not usable for the fit ({e})"
    fitted = fit_or_prior(history + mine, warm.memory)
    if problem:
        fitted.source += f"; {problem}"
    predicted = None
    if job.table_bytes and worker is not None:
        steps = worker.steps - (worker.resumed_from.step if worker.resumed_from else 0)
        shard = embedding_shard_bytes(job.table_bytes, worker.world_size)
        predicted = float(warm.memory.predict(shard, steps))
    return {"predicted_peak_bytes": predicted,
            "measured_peak_bytes": [float(x) for x in (worker.peak_rss_bytes or [])] if worker is not None else [],
            "predicted_by": warm.memory_note or warm.memory.source, "fitted": fitted.to_dict(),
            "points": [s.to_dict() for s in mine], "history_points": len(history)}


def _log_run_model(store: TrackingStore, run_id: str, scaler: DLRoverScaler, by_plan: list[dict[str, Any]],
                   memory: MemoryModel, measured: Mapping[str, Any]) -> str | None:
    """The runtime stage's model after the run, fitted (or the prior rescaled) on what the run measured, with
    the memory model fitted on the measured peaks; both go to MLflow as the run's models."""
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
    peaks = measured.get("measured_peak_bytes") or []
    return log_resource_model(
        store, run_id, model=online.model, dataset=job.dataset, model_family=job.model_family,
        final_plan=scaler.plan.to_dict(), memory=memory, samples_per_s=by_plan[-1]["samples_per_s"],
        peak_memory_bytes=max(peaks) if peaks else None, points=points,
        metrics={"memory.fit_mape": memory.fit_mape, "memory.loo_mape": memory.loo_mape,
                 "memory.n_points": float(memory.n_points)},
        extra={"points": [{"allocation": s.allocation.to_dict(), "samples_per_s": s.samples_per_s}
                          for s in points], "model_status": online.status,
               "memory_points": list(measured.get("points") or [])},
        register=True)


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
    unreadable: Event | None = None
    try:
        prior = ThroughputModel.from_dict(state["prior"]) if state.get("prior") else None
        memory = MemoryModel.from_dict(state["memory"]) if state.get("memory") else None
    except RECORD_ERRORS as e:  # ModelFitError is a ValueError
        prior, memory = None, None
        log.warning("stage 1 state unreadable (%r): recommending without a prior", e)
        unreadable = Event("runtime", "fallback", f"stage 1 state unreadable ({e!r}): recommending without a prior",
                           plan_before=ran.to_dict())
    thr = float(worker_result.get("samples_per_s") or 0.0)
    shares = [float(v) for v in (per_worker_samples or {}).values() if v is not None]
    # in one wall time a worker's step time is inversely proportional to the samples it got through
    steps = [1.0 / v if v > 0 else math.inf for v in shares] if len(shares) >= 2 else []
    obs = Observation(time_s=float(worker_result.get("wall_s", 0.0)), plan=ran, samples_per_s=thr if thr > 0 else None,
                      step=int(worker_result.get("steps", 0)) * ran.workers, worker_step_s=steps,
                      total_steps=float(j["total_samples"]) / max(ran.batch_size, 1))
    events: list[Event] = [unreadable] if unreadable is not None else []
    stage3 = InstabilityStage(desc, limits, cfg, memory)
    try:
        events += stage3.observe(obs)
    except MODEL_ERRORS as e:  # never crash the train task over a recommendation; a bug propagates
        events.append(Event("instability", "fallback", f"stage 3 failed ({e!r})", plan_before=ran.to_dict()))
    rt = RuntimeStage(desc, limits, replace(cfg, profile_samples=1, interval_s=0.0), prior, memory)
    try:
        events += rt.observe(obs)
    except MODEL_ERRORS as e:
        events.append(Event("runtime", "fallback", f"stage 2 failed ({e!r})", plan_before=ran.to_dict()))
    if thr <= 0:
        events.append(Event("runtime", "fallback", "the run reported no throughput: no model update",
                            plan_before=ran.to_dict()))
    for ev in events:
        ev.reason += " [recommendation: not executed; the elastic runtime that applies plans is a separate issue]"
    return events, rt.model.model if rt.model.samples else None, ran
