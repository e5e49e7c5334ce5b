"""Stage 1 of DLRover-RM, the warm start: the plans and fitted models of similar past jobs (same dataset
and model family) give the initial plan: the greedy search run on the history's model from the median
of their final plans, or that median alone when no model is usable; with no history (cold start), the
requested plan when it fits the limits (stage 2 corrects it by measurement), else the best plan within
the limits by the default (committed) model. The memory model is the newest one fitted on similar runs'
measured peaks, else the default prior, and the reason is recorded."""
from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from recforge.elastic.optimizer.errors import MODEL_ERRORS, RECORD_ERRORS, describe
from recforge.elastic.optimizer.events import Event
from recforge.elastic.optimizer.models.history import History, JobRecord
from recforge.elastic.optimizer.models.memory_model import (
    DEFAULT_MEMORY_MODEL,
    MemoryModel,
    MemorySample,
    embedding_shard_bytes,
    samples_from_dicts,
)
from recforge.elastic.optimizer.models.throughput_model import (
    Allocation,
    Sample,
    ThroughputModel,
    fit,
    fit_profile,
    load_profile,
)
from recforge.elastic.optimizer.plans import JobDescription, JobLimits, OptimizerConfig, PodPlan, ResourceLimitError
from recforge.elastic.optimizer.search import (
    clamp,
    job_steps,
    memory_for,
    pod_memory_at,
    rightsize_predicted,
    search,
)

log = logging.getLogger(__name__)


def _memory_from_history(plan: PodPlan, records: Sequence[JobRecord], mems: Sequence[MemoryModel],
                         cfg: OptimizerConfig, limits: JobLimits, job: JobDescription | None = None,
                         emb_factor: float = 1.0) -> PodPlan:
    """DLRover: pod memory = the largest peak similar jobs used x margin (servers from extra["peak_server_memory"]).
    With the job's tables, each worker peak is first converted to this plan's worker count (`pod_memory_at`),
    as a server's peak is to its server count: a job with more workers than the one that measured the peak
    holds a smaller shard each."""
    peaks = []
    for r in records:
        if not r.peak_memory_bytes:
            continue
        try:
            then = int(r.final_plan.get("workers") or plan.workers)
        except (TypeError, ValueError):
            then = plan.workers
        peaks.append(pod_memory_at(r.peak_memory_bytes, job, then, plan.workers, emb_factor=emb_factor)
                     if job is not None else r.peak_memory_bytes)
    if peaks and not mems:
        plan = replace(plan, memory_per_worker=max(peaks) * cfg.memory_margin)
    # a server's share of the embeddings scales with 1/servers: convert each job's peak to this plan's count
    server_need = [r.extra["peak_server_memory"] * max(int(r.final_plan.get("servers", 1) or 1), 1)
                   / max(plan.servers, 1)
                   for r in records if r.extra.get("peak_server_memory")]
    if server_need and plan.servers > 0:
        total = max(server_need) * plan.servers * cfg.memory_margin
        servers = max(plan.servers, math.ceil(total / limits.max_memory_per_pod))  # spread what one pod cannot hold
        plan = replace(plan, servers=min(servers, limits.max_servers),
                       memory_per_server=total / min(servers, limits.max_servers))
    return plan


def combine_models(models: Sequence[ThroughputModel]) -> ThroughputModel:
    """Coefficient-wise median over the models of the most common term set."""
    by_terms: dict[tuple, list[ThroughputModel]] = {}
    for m in models:
        by_terms.setdefault(tuple(m.terms), []).append(m)
    terms, group = max(by_terms.items(), key=lambda kv: len(kv[1]))
    coef = tuple(statistics.median(m.coef[i] for m in group) for i in range(len(terms)))
    fitted = [m.fit_mape for m in group if not math.isnan(m.fit_mape)]
    return ThroughputModel(terms, coef, fit_mape=statistics.median(fitted) if fitted else float("nan"),
                           n_points=sum(m.n_points for m in group),
                           meta={"source": f"median of {len(group)} history models"})


@dataclass
class WarmStart:
    """Stage 1's outcome: the initial plan, its events, the prior model for stage 2, the memory model."""

    plan: PodPlan
    events: list[Event]
    prior: ThroughputModel | None
    memory: MemoryModel
    records: list[JobRecord] = field(default_factory=list)
    memory_note: str = ""  # which memory model stage 1 uses and why


def choose_memory(records: Sequence[JobRecord], default: MemoryModel | None) -> tuple[MemoryModel, str]:
    """The newest memory model fitted on measured peaks among similar runs (history is newest first; the
    pipeline's runs are registered model versions), else the default prior; with the reason."""
    for r in records:
        if r.memory is not None and r.memory.fitted:
            where = f"run {r.run_id}" + (f", registered {r.extra['registered_version']}"
                                         if r.extra.get("registered_version") else "")
            loo = "" if math.isnan(r.memory.loo_mape) else f", leave-one-run-out error {r.memory.loo_mape:.1%}"
            return r.memory, f"fitted memory model of {where} ({r.memory.source}{loo})"
    prior = default if default is not None else DEFAULT_MEMORY_MODEL
    why = "no similar run" if not records else f"none of the {len(records)} similar run(s) has a fitted memory model"
    return prior, f"{why}: prior ({prior.source or 'unnamed'})"


def history_memory_points(records: Sequence[JobRecord]) -> list[MemorySample]:
    """The measured worker peaks similar runs left in extra["memory_points"] (malformed ones skipped)."""
    out: list[MemorySample] = []
    for r in records:
        out += samples_from_dicts((r.extra or {}).get("memory_points") or [], run=r.run_id or "")
    return out


def warm_start(job: JobDescription, history: History | None, limits: JobLimits,
               cfg: OptimizerConfig = OptimizerConfig(), default_model: ThroughputModel | None = None,
               default_memory: MemoryModel | None = None) -> WarmStart:
    """Stage 1: the initial plan from similar past jobs (see the module docstring). Raises ResourceLimitError for
    limits that cannot hold one worker; a history store that cannot be read (`history.unavailable`), a malformed
    record or a degenerate model (errors.py) falls back with a "fallback" event naming the cause; anything else
    propagates."""
    limits.check()
    events: list[Event] = []
    records: list[JobRecord] = []
    problems: list[str] = []
    unreadable: BaseException | None = None
    if history is not None:
        try:
            records = list(history.similar(job.dataset, job.model_family))
        except history.unavailable as e:  # a history store that is down must not stop a job from starting
            unreadable = e
            problems.append(f"history lookup failed: {e!r}")
        problems.extend(getattr(history, "problems", []) or [])
    inputs = {"dataset": job.dataset, "model_family": job.model_family, "requested": job.requested.to_dict(),
              "limits": limits.__dict__, "similar_jobs": len(records), "history_problems": problems[:20]}
    if unreadable is not None:
        events.append(Event("warm_start", "fallback", f"history store unavailable ({describe(unreadable)}): "
                            "planning as if no similar job had run", inputs=inputs,
                            plan_before=job.requested.to_dict()))
    models = [r.model for r in records if r.model is not None]
    mems = [r.memory for r in records if r.memory is not None and r.memory.fitted]
    memory, memory_note = choose_memory(records, default_memory)
    inputs["memory_model"] = {**memory.to_dict(), "chosen": memory_note}
    requested = clamp(job.requested, limits)

    try:
        out = _warm_from_history(job, limits, cfg, default_model, records, models, mems, memory, requested, inputs,
                                 events)
    except ResourceLimitError:
        raise
    except (*MODEL_ERRORS, *RECORD_ERRORS) as e:  # a degenerate model or a malformed record of the history
        events.append(Event("warm_start", "fallback", f"warm start from history failed ({describe(e)}); "
                            "cold start with the requested plan", inputs=inputs, plan_before=job.requested.to_dict(),
                            plan_after=requested.to_dict()))
        out = WarmStart(requested, events, default_model, memory, records)
    out.memory_note = memory_note
    if events and job.table_bytes and not job.parameter_server:  # what the memory model expects of the plan
        shard = embedding_shard_bytes(job.table_bytes, out.plan.workers)
        events[-1].prediction["peak_memory_bytes_per_worker"] = memory.predict(
            shard, job_steps(job, out.plan) / out.plan.workers)
    return out


def history_points(records: Sequence[JobRecord]) -> list[Sample]:
    """Measured (allocation, samples/s) points that past runs left in extra["points"]; malformed ones are skipped."""
    out = []
    for r in records:
        for p in (r.extra or {}).get("points", []) or []:
            try:
                s = Sample(Allocation.from_dict(p["allocation"]), float(p["samples_per_s"]))
            except (KeyError, TypeError, ValueError):
                continue
            if s.samples_per_s > 0 and math.isfinite(s.samples_per_s):
                out.append(s)
    return out


def _refit_on_history(records: Sequence[JobRecord], prior: ThroughputModel,
                      events: list[Event] | None = None) -> tuple[ThroughputModel, str]:
    """Past runs of similar jobs at different plans are profile points of the same model: fit them together. A
    fit that fails keeps `prior` and appends a "fallback" event naming why to `events`."""
    pts = history_points(records)
    configs = {(s.allocation.workers, s.allocation.cpu_per_worker, s.allocation.batch_size, s.allocation.servers,
                s.allocation.cpu_per_server) for s in pts}
    if len(configs) < 3:
        return prior, ""
    try:
        m = fit(pts, prior.terms, prior=prior, prior_strength=0.3)
    except MODEL_ERRORS as e:  # keep the prior; say why
        if events is not None:
            events.append(Event("warm_start", "fallback", f"refit on {len(pts)} history points failed "
                                f"({describe(e)}): the median of the similar jobs' models", inputs={
                                    "points": len(pts), "configurations": len(configs), "model": prior.to_dict()}))
        return prior, f"; refit on {len(pts)} history points failed ({e!r})"
    m.meta = {"source": f"refit on {len(pts)} points of {len(records)} similar runs ({len(configs)} configurations)"}
    return m, (f"; refitted on {len(pts)} measured points of past runs ({len(configs)} configurations), "
               f"MAPE {m.fit_mape:.1%}")


def _median_plan(requested: PodPlan, records: Sequence[JobRecord], job: JobDescription) -> PodPlan | None:
    """The median of the final plans of similar jobs (memory: the largest), or None without any valid plan."""
    finals = []
    for r in records:
        try:
            finals.append(PodPlan.from_dict(r.final_plan))
        except (TypeError, ValueError):
            pass  # an incomplete plan in a record: skip it
    if not finals:
        return None
    plan = replace(requested, workers=max(1, int(round(statistics.median(p.workers for p in finals)))),
                   cpu_per_worker=float(statistics.median(p.cpu_per_worker for p in finals)),
                   memory_per_worker=float(max(p.memory_per_worker for p in finals)))
    if job.parameter_server:
        plan = replace(plan, servers=max(1, int(round(statistics.median(p.servers for p in finals)))),
                       cpu_per_server=float(statistics.median(p.cpu_per_server for p in finals)),
                       memory_per_server=float(max(p.memory_per_server for p in finals)))
    return plan


def _warm_from_history(job: JobDescription, limits: JobLimits, cfg: OptimizerConfig,
                       default_model: ThroughputModel | None, records: list[JobRecord], models: list[ThroughputModel],
                       mems: list[MemoryModel], memory: MemoryModel, requested: PodPlan, inputs: dict[str, Any],
                       events: list[Event]) -> WarmStart:
    if models:
        prior, refit_note = _refit_on_history(records, combine_models(models), events)
        # DLRover predicts a plan close to the final one: start from where similar jobs ended (their median
        # final plan), and let the greedy search move from there, growing or shrinking
        start = _median_plan(requested, records, job) or replace(
            requested, workers=1, cpu_per_worker=limits.min_cpu_per_worker, servers=1 if job.parameter_server else 0,
            cpu_per_server=limits.min_cpu_per_worker if job.parameter_server else 0.0)
        start = clamp(memory_for(start, job, memory, cfg, limits.min_memory_per_pod), limits)
        plan, moves = search(start, prior, limits, cfg, job, memory if mems else None)
        cpu_note = ""
        if cfg.rightsize:  # what stage 2 would right-size the plan's cores to once measured: not a relaunch later
            sized, util = rightsize_predicted(plan, prior, limits, cfg, job.host_cores)
            searched = plan.cpu_per_worker
            if sized.cpu_per_worker < searched:
                # then the search again without more cores per worker, as stage 2 searches after right-sizing
                plan, more = search(sized, prior, limits, cfg, job, memory if mems else None,
                                    frozen=frozenset({"add_cpu_per_worker"}))
                cpu_note = (f"; {sized.cpu_per_worker:g} cores per worker (the search's {searched:g}) by stage 2's "
                            f"right-sizing rule on the predicted utilization ({util:.0%}), then {len(more)} unit "
                            "move(s) without more cores")
                moves = moves + more
        plan = _memory_from_history(plan, records, mems, cfg, limits, job, memory.emb_factor)
        plan = clamp(plan, limits)
        pred = prior.predict(plan.allocation(job.host_cores))
        events.append(Event("warm_start", "initial_plan",
                            f"{len(models)} similar job(s) with a fitted model: greedy search on their median "
                            f"model{refit_note} ({len(moves)} unit moves from their median final plan, stopped at "
                            f"marginal ratio < {cfg.min_gain_ratio}){cpu_note}",
                            inputs={**inputs, "model": prior.to_dict()},
                            prediction={"samples_per_s": pred,
                                        "requested_samples_per_s": prior.predict(requested.allocation(job.host_cores))},
                            plan_before=job.requested.to_dict(), plan_after=plan.to_dict()))
        return WarmStart(plan, events, prior, memory, records)

    median = _median_plan(requested, records, job)
    if median is not None:
        plan = clamp(_memory_from_history(median, records, mems, cfg, limits, job, memory.emb_factor), limits)
        events.append(Event("warm_start", "initial_plan",
                            f"{len(records)} similar job(s) but no usable fitted model: median of their final plans",
                            inputs=inputs, prediction={}, plan_before=job.requested.to_dict(),
                            plan_after=plan.to_dict()))
        return WarmStart(plan, events, default_model, memory, records)

    reason = "no similar job in history: cold start with the requested plan (it fits the limits; stage 2 " \
             "corrects it by measurement)"
    plan = requested
    prediction: dict[str, Any] = {}
    hint = None
    if default_model is not None:  # what the default model expects, and what it would choose within the limits
        try:
            hint, _ = search(replace(requested, workers=1, cpu_per_worker=limits.min_cpu_per_worker), default_model,
                             limits, cfg, job)
            prediction = {"default_model_suggests": hint.to_dict(),
                          "suggested_samples_per_s": default_model.predict(hint.allocation(job.host_cores)),
                          "default_model": default_model.to_dict()}
        except MODEL_ERRORS as e:  # the clamped request instead; say why
            hint, prediction = None, {"default_model_error": repr(e)}
            events.append(Event("warm_start", "fallback", f"the default model found no plan ({describe(e)}): "
                                "the requested plan, clamped to the limits", inputs={
                                    "model": default_model.to_dict()}, plan_before=job.requested.to_dict()))
    if requested != job.requested:  # the request does not fit: plan by the default model, else the clamped request
        asked = f"{job.requested.workers}x{job.requested.cpu_per_worker:g} cores"
        if hint is not None:
            plan = replace(hint, memory_per_worker=requested.memory_per_worker)
            reason = (f"no similar job in history and the request ({asked}) exceeds the limits "
                      f"({limits.cpu:g} cores): the default model's best plan within them")
        else:
            reason = (f"no similar job in history: cold start with the requested plan clamped to the limits "
                      f"(from {asked})")
    if default_model is not None:
        prediction["samples_per_s"] = default_model.predict(plan.allocation(job.host_cores))
    events.append(Event("warm_start", "cold_start", reason, inputs=inputs, prediction=prediction,
                        plan_before=job.requested.to_dict(), plan_after=plan.to_dict()))
    return WarmStart(plan, events, default_model, memory, records)


_LOCAL_MODEL: list[tuple[ThroughputModel | None, str]] = []  # (the model, why there is none)


def local_default_model() -> ThroughputModel | None:
    """Our trainer's model fitted on the committed profile (optimizer/models/profiles/), the cold-start prior for
    the local backend; None (and a logged warning) when the profile is missing or cannot be fitted
    (`local_default_model_problem` says why)."""
    if not _LOCAL_MODEL:
        try:
            samples, _ = load_profile()
            _LOCAL_MODEL.append((fit_profile(samples).model, ""))
        except (OSError, ValueError) as e:  # documented fallback: no prior, the requested plan (missing or bad file)
            log.warning("no default resource model for the local trainer (%r): cold starts use the request", e)
            _LOCAL_MODEL.append((None, f"committed profile unusable ({describe(e)})"))
    return _LOCAL_MODEL[0][0]


def local_default_model_problem() -> str:
    """Why `local_default_model()` is None ("" when it is not)."""
    local_default_model()
    return _LOCAL_MODEL[0][1]
