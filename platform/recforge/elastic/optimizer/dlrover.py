"""DLRover-RM's three-stage resource optimizer behind the `elastic.Policy` seam.

- Stage 1 `warm_start`: the plans and fitted models of similar past jobs (same dataset and model
  family) give the initial plan: the greedy search below run on the history's model, or the median
  of their final plans when no model is usable; with no history, the requested plan (cold start).
- Stage 2 `RuntimeStage`: after `profile_samples` throughput samples at the current plan, refit the
  online model and take the unit actions (add a worker, a core per worker, a server, a core per
  server) with the largest predicted gain per unit of added cost, up to `max_units_per_step`, while
  the marginal gain ratio (dTheta/dcost) / (Theta/cost) stays >= `min_gain_ratio` (DLRover: 0.2) and
  the plan fits the limits; shrink when a unit's removal loses less than `shrink_ratio`; never change
  more often than `interval_s` (servers: `server_interval_s`).
- Stage 3 `InstabilityStage`: a straggler (step time > 2x the median of the other workers) is relaunched elsewhere; a hot
  server (CPU >= 0.9 over the last 3 samples, or shard load > 2x the median) gets more cores; predicted
  memory exhaustion or an OOM relaunches with more memory (double, at most +8 GiB a step, 64 GiB cap);
  a job pending past `pending_timeout_s` is relaunched smaller.

Each decision is an `Event` (inputs, prediction, reason). Nothing here executes a plan.
"""
from __future__ import annotations

import logging
import math
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from recforge.elastic.optimizer.events import Event
from recforge.elastic.optimizer.history import History, JobRecord
from recforge.elastic.optimizer.memory_model import (
    DEFAULT_MEMORY_MODEL, GiB, MemoryModel, MemoryTrend, embedding_shard_bytes, next_memory,
)
from recforge.elastic.policy import JobInfo, ResourcePlan
from recforge.elastic.optimizer.throughput_model import (
    PS_TERMS, Allocation, OnlineThroughputModel, Sample, ThroughputModel, fit,
)

log = logging.getLogger(__name__)


class ResourceLimitError(ValueError):
    """The job's resource limits cannot hold even one minimal worker."""


@dataclass(frozen=True)
class JobPlan:
    workers: int
    cpu_per_worker: float
    memory_per_worker: float  # bytes
    batch_size: int = 512
    servers: int = 0
    cpu_per_server: float = 0.0
    memory_per_server: float = 0.0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.cpu_per_worker <= 0 or self.memory_per_worker <= 0:
            raise ValueError(f"JobPlan needs workers >= 1, cpu and memory > 0: {self}")

    @property
    def cpu_total(self) -> float:
        return self.workers * self.cpu_per_worker + self.servers * self.cpu_per_server

    @property
    def memory_total(self) -> float:
        return self.workers * self.memory_per_worker + self.servers * self.memory_per_server

    def allocation(self, host_cores: float | None = None) -> Allocation:
        return Allocation(self.workers, self.cpu_per_worker, self.batch_size, self.servers,
                          self.cpu_per_server, host_cores)

    def to_resource_plan(self) -> ResourcePlan:
        return ResourcePlan(workers=self.workers, threads_per_worker=max(1, int(round(self.cpu_per_worker))))

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobPlan":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class JobLimits:
    """What one job may use in total (an ElasticJob's resourceLimits) and per pod."""

    cpu: float
    memory: float
    max_workers: int = 60
    max_servers: int = 15
    min_cpu_per_worker: float = 1.0
    max_cpu_per_worker: float = 32.0
    max_cpu_per_server: float = 32.0
    min_memory_per_pod: float = 1 * GiB
    max_memory_per_pod: float = 64 * GiB

    def check(self) -> None:
        if self.cpu < self.min_cpu_per_worker:
            raise ResourceLimitError(
                f"limits.cpu={self.cpu} is below one worker's minimum of {self.min_cpu_per_worker} core(s)")
        if self.memory < self.min_memory_per_pod:
            raise ResourceLimitError(
                f"limits.memory={self.memory / GiB:.2f} GiB is below one worker's minimum of "
                f"{self.min_memory_per_pod / GiB:.2f} GiB")
        if self.max_workers < 1:
            raise ResourceLimitError(f"limits.max_workers={self.max_workers}: a job needs at least one worker")

    def fits(self, plan: JobPlan) -> bool:
        return (plan.cpu_total <= self.cpu + 1e-9 and plan.memory_total <= self.memory + 1e-6
                and plan.workers <= self.max_workers and plan.servers <= self.max_servers
                and self.min_cpu_per_worker <= plan.cpu_per_worker <= self.max_cpu_per_worker
                and plan.cpu_per_server <= self.max_cpu_per_server
                and plan.memory_per_worker <= self.max_memory_per_pod)

    @classmethod
    def of_this_machine(cls) -> "JobLimits":
        import psutil

        return cls(cpu=float(os.cpu_count() or 1), memory=float(psutil.virtual_memory().total) * 0.8,
                   max_cpu_per_worker=float(os.cpu_count() or 1))


@dataclass(frozen=True)
class OptimizerConfig:
    min_gain_ratio: float = 0.2        # DLRover: stop scaling up below this marginal speed ratio
    shrink_ratio: float = 0.05         # give a unit back when removing it loses less than this
    max_units_per_step: int = 4        # DLRover: at most +4 workers a step
    interval_s: float = 300.0          # DLRover: plans applied at most every 300 s
    server_interval_s: float = 3600.0  # DLRover: PS changes at least an hour apart
    profile_samples: int = 3           # samples at a plan before stage 2 acts on it
    gib_per_core: float = 4.0          # memory counted in cores when comparing costs
    straggler_factor: float = 2.0
    hot_cpu_util: float = 0.9
    hot_samples: int = 3
    hot_shard_factor: float = 2.0
    memory_margin: float = 1.2
    oom_step_bytes: float = 8 * GiB
    memory_cap_bytes: float = 64 * GiB
    pending_timeout_s: float = 900.0
    default_worker_memory: float = 4 * GiB
    rightsize: bool = True             # DLRover: pods shrink to what they use (CPU x1.25, memory x1.5 / x1.2)
    low_util: float = 0.7              # right-size a pod group whose peak CPU utilization is below this
    cpu_headroom: float = 1.25
    worker_memory_margin: float = 1.5  # DLRover's worker memory margin (servers use memory_margin)
    max_pending_relaunches: int = 2


@dataclass
class JobDescription:
    """What the optimizer knows about a job before it runs."""

    dataset: str
    model_family: str
    requested: JobPlan
    total_samples: float = 0.0
    table_bytes: Sequence[float] = ()
    parameter_server: bool = False
    host_cores: float | None = None  # all workers share one host of this many cores (local backend)


# ---------------------------------------------------------------------------------------------
# the greedy marginal-gain search shared by stages 1 and 2
# ---------------------------------------------------------------------------------------------
@dataclass
class Move:
    action: str
    plan: JobPlan
    gain: float        # predicted samples/s change (negative for a shrink)
    cost: float        # added core-equivalents (negative for a shrink)
    ratio: float       # (gain / cost) / (throughput / total cost)


def _cost(plan: JobPlan, cfg: OptimizerConfig) -> float:
    return plan.cpu_total + plan.memory_total / GiB / cfg.gib_per_core


def _candidates(plan: JobPlan, grow: bool, ps: bool) -> list[tuple[str, JobPlan]]:
    d = 1 if grow else -1
    verb = "add" if grow else "remove"
    changes = [("worker", {"workers": plan.workers + d}), ("cpu_per_worker", {"cpu_per_worker": plan.cpu_per_worker + d})]
    if ps:
        changes += [("server", {"servers": plan.servers + d}), ("cpu_per_server", {"cpu_per_server": plan.cpu_per_server + d})]
    out = []
    for name, change in changes:
        if min(change.values()) < 1:
            continue
        out.append((f"{verb}_{name}", replace(plan, **change)))
    return out


def _memory_for(plan: JobPlan, job: JobDescription, mem: MemoryModel, cfg: OptimizerConfig, floor: float) -> JobPlan:
    """Worker memory follows the worker count: the embedding shard shrinks as workers are added."""
    if job.parameter_server or not job.table_bytes:
        return plan
    need = mem.required_bytes(embedding_shard_bytes(job.table_bytes, plan.workers),
                              _steps(job, plan) / plan.workers, cfg.memory_margin)  # the memory model counts per-worker steps
    return replace(plan, memory_per_worker=max(floor, need))


def _steps(job: JobDescription, plan: JobPlan) -> float:
    """The job's total in batches of the whole job (Observation.step counts these), whatever the worker count."""
    return job.total_samples / max(plan.batch_size, 1)


def best_moves(plan: JobPlan, model: ThroughputModel, limits: JobLimits, cfg: OptimizerConfig, job: JobDescription,
               mem: MemoryModel | None = None, *, allow_servers: bool = True,
               frozen: frozenset[str] = frozenset()) -> tuple[Move | None, Move | None]:
    """The best growing move and the cheapest shrinking move (by predicted marginal ratio); actions in
    `frozen` are not considered."""
    host = job.host_cores
    cands: list[tuple[bool, str, JobPlan]] = []
    for is_grow in (True, False):
        for action, p in _candidates(plan, is_grow, job.parameter_server and allow_servers):
            if action in frozen:
                continue
            if mem is not None:
                p = _memory_for(p, job, mem, cfg, limits.min_memory_per_pod)
            if is_grow and not limits.fits(p):
                continue
            cands.append((is_grow, action, p))
    thr = model.predict([plan.allocation(host)] + [p.allocation(host) for _, _, p in cands])
    base, base_cost = float(thr[0]), _cost(plan, cfg)
    avg = base / base_cost
    grow, shrink = None, None
    for (is_grow, action, p), t in zip(cands, thr[1:]):
        gain = float(t) - base
        cost = _cost(p, cfg) - base_cost
        if cost == 0:
            continue
        # for a shrink gain<0 and cost<0: the ratio is the throughput lost per unit saved
        ratio = (gain / cost) / avg if avg > 0 else 0.0
        mv = Move(action, p, gain, cost, ratio)
        if is_grow and (grow is None or ratio > grow.ratio):
            grow = mv
        if not is_grow and (shrink is None or ratio < shrink.ratio):
            shrink = mv
    return grow, shrink


def search(plan: JobPlan, model: ThroughputModel, limits: JobLimits, cfg: OptimizerConfig, job: JobDescription,
           mem: MemoryModel | None = None, *, max_units: int | None = None, allow_servers: bool = True,
           frozen: frozenset[str] = frozenset()) -> tuple[JobPlan, list[Move]]:
    """Greedy marginal-gain search from `plan`: grow while the ratio holds, else shrink while it is cheap."""
    moves: list[Move] = []
    limit = max_units if max_units is not None else 10_000
    while len(moves) < limit:
        grow, shrink = best_moves(plan, model, limits, cfg, job, mem, allow_servers=allow_servers, frozen=frozen)
        if grow is not None and grow.ratio >= cfg.min_gain_ratio and grow.gain > 0:
            if moves and moves[-1].action.startswith("remove"):
                break  # never undo a shrink in the same search
            moves.append(grow)
            plan = grow.plan
        elif shrink is not None and shrink.ratio < cfg.shrink_ratio and (not moves or moves[-1].action.startswith("remove")):
            moves.append(shrink)
            plan = shrink.plan
        else:
            break
    return plan, moves


def clamp(plan: JobPlan, limits: JobLimits) -> JobPlan:
    """The largest plan like `plan` that fits the limits: fewer cores per worker, then fewer workers."""
    limits.check()
    cpu = min(max(plan.cpu_per_worker, limits.min_cpu_per_worker), limits.max_cpu_per_worker)
    mem = min(max(plan.memory_per_worker, limits.min_memory_per_pod), limits.max_memory_per_pod)
    p = replace(plan, cpu_per_worker=cpu, memory_per_worker=mem, workers=min(plan.workers, limits.max_workers),
                servers=min(plan.servers, limits.max_servers),
                cpu_per_server=min(plan.cpu_per_server, limits.max_cpu_per_server),
                memory_per_server=min(plan.memory_per_server, limits.max_memory_per_pod))
    while not limits.fits(p):
        if p.servers > 1 and p.servers * p.cpu_per_server > p.workers * p.cpu_per_worker:
            p = replace(p, servers=p.servers - 1)
        elif p.workers > 1:
            p = replace(p, workers=p.workers - 1)
        elif p.cpu_per_worker > limits.min_cpu_per_worker:
            p = replace(p, cpu_per_worker=max(limits.min_cpu_per_worker, min(p.cpu_per_worker - 1, limits.cpu)))
        elif p.memory_per_worker > limits.min_memory_per_pod:
            p = replace(p, memory_per_worker=max(limits.min_memory_per_pod, min(limits.memory, p.memory_per_worker / 2)))
        elif p.servers > 1:
            p = replace(p, servers=p.servers - 1)
        elif p.cpu_per_server > 1:
            p = replace(p, cpu_per_server=p.cpu_per_server - 1)
        elif p.memory_per_server > limits.min_memory_per_pod:
            p = replace(p, memory_per_server=max(limits.min_memory_per_pod, p.memory_per_server / 2))
        else:
            raise ResourceLimitError(f"limits {limits} cannot hold the minimal plan {p.to_dict()}")
    return p


# ---------------------------------------------------------------------------------------------
# stage 1
# ---------------------------------------------------------------------------------------------
def _memory_from_history(plan: JobPlan, records: Sequence[JobRecord], mems: Sequence[MemoryModel],
                         cfg: OptimizerConfig, limits: JobLimits) -> JobPlan:
    """DLRover: pod memory = the largest peak similar jobs used x margin (servers from extra["peak_server_memory"])."""
    peaks = [r.peak_memory_bytes for r in records if r.peak_memory_bytes]
    if peaks and not mems:
        plan = replace(plan, memory_per_worker=max(peaks) * cfg.memory_margin)
    # a server's share of the embeddings scales with 1/servers: convert each job's peak to this plan's count
    server_need = [r.extra["peak_server_memory"] * max(int(r.final_plan.get("servers", 1) or 1), 1) / max(plan.servers, 1)
                   for r in records if r.extra.get("peak_server_memory")]
    if server_need and plan.servers > 0:
        total = max(server_need) * plan.servers * cfg.memory_margin
        servers = max(plan.servers, math.ceil(total / limits.max_memory_per_pod))  # spread what one pod cannot hold
        plan = replace(plan, servers=min(servers, limits.max_servers), memory_per_server=total / min(servers, limits.max_servers))
    return plan


def combine_models(models: Sequence[ThroughputModel]) -> ThroughputModel:
    """Coefficient-wise median over the models of the most common term set."""
    by_terms: dict[tuple, list[ThroughputModel]] = {}
    for m in models:
        by_terms.setdefault(tuple(m.terms), []).append(m)
    terms, group = max(by_terms.items(), key=lambda kv: len(kv[1]))
    coef = [statistics.median(m.coef[i] for m in group) for i in range(len(terms))]
    return ThroughputModel(terms, coef, fit_mape=statistics.median(m.fit_mape for m in group if not math.isnan(m.fit_mape)) if any(not math.isnan(m.fit_mape) for m in group) else float("nan"),
                           n_points=sum(m.n_points for m in group), meta={"source": f"median of {len(group)} history models"})


@dataclass
class WarmStart:
    plan: JobPlan
    events: list[Event]
    prior: ThroughputModel | None
    memory: MemoryModel
    records: list[JobRecord] = field(default_factory=list)


def warm_start(job: JobDescription, history: History | None, limits: JobLimits,
               cfg: OptimizerConfig = OptimizerConfig(), default_model: ThroughputModel | None = None) -> WarmStart:
    limits.check()
    events: list[Event] = []
    records: list[JobRecord] = []
    problems: list[str] = []
    if history is not None:
        try:
            records = list(history.similar(job.dataset, job.model_family))
        except Exception as e:  # a broken history store must not stop a job from starting
            problems.append(f"history lookup failed: {e!r}")
        problems.extend(getattr(history, "problems", []) or [])
    inputs = {"dataset": job.dataset, "model_family": job.model_family, "requested": job.requested.to_dict(),
              "limits": limits.__dict__, "similar_jobs": len(records), "history_problems": problems[:20]}
    models = [r.model for r in records if r.model is not None]
    mems = [r.memory for r in records if r.memory is not None]
    memory = mems[0] if mems else DEFAULT_MEMORY_MODEL
    requested = clamp(job.requested, limits)

    try:
        return _warm_from_history(job, limits, cfg, default_model, records, models, mems, memory, requested, inputs, events)
    except ResourceLimitError:
        raise
    except Exception as e:  # never crash inside the optimizer: fall back to the requested plan, say why
        events.append(Event("warm_start", "fallback", f"warm start from history failed ({type(e).__name__}: {e}); "
                            "cold start with the requested plan", inputs=inputs, plan_before=job.requested.to_dict(),
                            plan_after=requested.to_dict()))
        return WarmStart(requested, events, default_model, memory, records)


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


def _refit_on_history(records, prior: ThroughputModel | None) -> tuple[ThroughputModel | None, str]:
    """Past runs of similar jobs at different plans are profile points of the same model: fit them together."""
    pts = history_points(records)
    configs = {(s.allocation.workers, s.allocation.cpu_per_worker, s.allocation.batch_size, s.allocation.servers,
                s.allocation.cpu_per_server) for s in pts}
    if prior is None or len(configs) < 3:
        return prior, ""
    try:
        m = fit(pts, prior.terms, prior=prior, prior_strength=0.3)
    except Exception as e:  # keep the prior; say why
        return prior, f"; refit on {len(pts)} history points failed ({e!r})"
    m.meta = {"source": f"refit on {len(pts)} points of {len(records)} similar runs ({len(configs)} configurations)"}
    return m, f"; refitted on {len(pts)} measured points of past runs ({len(configs)} configurations), MAPE {m.fit_mape:.1%}"


def _median_plan(requested: JobPlan, records: Sequence[JobRecord], job: JobDescription) -> JobPlan | None:
    """The median of the final plans of similar jobs (memory: the largest), or None without any valid plan."""
    finals = []
    for r in records:
        try:
            finals.append(JobPlan.from_dict(r.final_plan))
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


def _warm_from_history(job, limits, cfg, default_model, records, models, mems, memory, requested, inputs, events) -> WarmStart:
    if models:
        prior, refit_note = _refit_on_history(records, combine_models(models))
        # DLRover predicts a plan close to the final one: start from where similar jobs ended (their median
        # final plan), and let the greedy search move from there, growing or shrinking
        start = _median_plan(requested, records, job) or replace(
            requested, workers=1, cpu_per_worker=limits.min_cpu_per_worker, servers=1 if job.parameter_server else 0,
            cpu_per_server=limits.min_cpu_per_worker if job.parameter_server else 0.0)
        start = clamp(_memory_for(start, job, memory, cfg, limits.min_memory_per_pod), limits)
        plan, moves = search(start, prior, limits, cfg, job, memory if mems else None)
        plan = _memory_from_history(plan, records, mems, cfg, limits)
        plan = clamp(plan, limits)
        pred = prior.predict(plan.allocation(job.host_cores))
        events.append(Event("warm_start", "initial_plan",
                            f"{len(models)} similar job(s) with a fitted model: greedy search on their median model{refit_note} "
                            f"({len(moves)} unit moves from their median final plan, stopped at marginal ratio < {cfg.min_gain_ratio})",
                            inputs={**inputs, "model": prior.to_dict()},
                            prediction={"samples_per_s": pred,
                                        "requested_samples_per_s": prior.predict(requested.allocation(job.host_cores))},
                            plan_before=job.requested.to_dict(), plan_after=plan.to_dict()))
        return WarmStart(plan, events, prior, memory, records)

    plan = _median_plan(requested, records, job)
    if plan is not None:
        plan = clamp(_memory_from_history(plan, records, mems, cfg, limits), limits)
        events.append(Event("warm_start", "initial_plan",
                            f"{len(records)} similar job(s) but no usable fitted model: median of their final plans",
                            inputs=inputs, prediction={}, plan_before=job.requested.to_dict(), plan_after=plan.to_dict()))
        return WarmStart(plan, events, default_model, memory, records)

    reason = "no similar job in history: cold start with the requested plan (clamped to the limits)"
    if requested != job.requested:
        reason += f"; clamped from {job.requested.workers}x{job.requested.cpu_per_worker} cores"
    prediction: dict[str, Any] = {}
    if default_model is not None:  # what the default model expects, and what it would have chosen (a hint only)
        try:
            hint, _ = search(replace(requested, workers=1, cpu_per_worker=limits.min_cpu_per_worker), default_model,
                             limits, cfg, job)
            prediction = {"samples_per_s": default_model.predict(requested.allocation(job.host_cores)),
                          "default_model_suggests": hint.to_dict(),
                          "suggested_samples_per_s": default_model.predict(hint.allocation(job.host_cores)),
                          "default_model": default_model.to_dict()}
        except Exception as e:
            prediction = {"default_model_error": repr(e)}
    events.append(Event("warm_start", "cold_start", reason, inputs=inputs, prediction=prediction,
                        plan_before=job.requested.to_dict(), plan_after=requested.to_dict()))
    return WarmStart(requested, events, default_model, memory, records)


# ---------------------------------------------------------------------------------------------
# stages 2 and 3
# ---------------------------------------------------------------------------------------------
@dataclass
class Observation:
    """One report from the job's profiler (the job master)."""

    time_s: float
    plan: JobPlan
    samples_per_s: float | None = None
    step: int = 0                                 # batches done by the whole job (samples / batch size)
    worker_step_s: Sequence[float] = ()           # recent mean step time per worker
    worker_cpu_util: Sequence[float] = ()         # per worker: cores used / cores allocated (0..1)
    worker_memory: Sequence[float] = ()           # RSS bytes per worker
    server_memory: Sequence[float] = ()           # RSS bytes per server
    server_cpu_util: Sequence[Sequence[float]] = ()  # per server: recent utilization samples (0..1)
    shard_load: Sequence[float] = ()              # per server / embedding shard: lookups or bytes
    pending_s: float = 0.0
    oom_workers: Sequence[int] = ()               # workers that were OOM-killed since the last report
    oom_servers: Sequence[int] = ()
    total_steps: float | None = None


class RuntimeStage:
    """Stage 2: model-driven scaling, paced, within limits."""

    def __init__(self, job: JobDescription, limits: JobLimits, cfg: OptimizerConfig = OptimizerConfig(),
                 prior: ThroughputModel | None = None, memory: MemoryModel | None = None,
                 terms: Sequence[str] | None = None) -> None:
        self.job, self.limits, self.cfg = job, limits, cfg
        terms = tuple(terms or (prior.terms if prior is not None else PS_TERMS))
        self.model = OnlineThroughputModel(terms, prior, min_points=3)
        self.memory = memory
        self.last_change_s: float | None = None
        self.last_server_change_s: float | None = None
        self.samples_at_plan = 0
        self._plan: JobPlan | None = None
        self._last_hold = ""
        self._server_mem = MemoryTrend()

    def observe(self, obs: Observation) -> list[Event]:
        if obs.plan != self._plan:
            self._plan, self.samples_at_plan = obs.plan, 0
        if obs.server_memory:
            self._server_mem.add(obs.step, max(obs.server_memory))
        if obs.samples_per_s is not None and obs.samples_per_s > 0 and obs.pending_s <= 0:
            self.model.add(Sample(obs.plan.allocation(self.job.host_cores), float(obs.samples_per_s)), refit=False)
            self.samples_at_plan += 1
        if self.samples_at_plan < self.cfg.profile_samples:
            return self._hold(f"profiling: {self.samples_at_plan} of {self.cfg.profile_samples} samples at this plan", obs)
        if self.last_change_s is not None and obs.time_s - self.last_change_s < self.cfg.interval_s:
            return self._hold(f"pacing: {obs.time_s - self.last_change_s:.0f}s since the last change < {self.cfg.interval_s:.0f}s", obs)
        if self.model.samples:
            try:
                self.model.refit()
            except Exception as e:  # keep the previous model; say why
                self.model.status = f"refit failed ({e!r}): previous model kept"
        model = self.model.model
        if model is None:
            return self._hold(f"no model yet ({self.model.status})", obs, action="fallback")
        allow_servers = self.last_server_change_s is None or obs.time_s - self.last_server_change_s >= self.cfg.server_interval_s
        start, notes = self._rightsize(obs, allow_servers) if self.cfg.rightsize else (obs.plan, [])
        try:
            plan, moves = search(start, model, self.limits, self.cfg, self.job, self.memory,
                                 max_units=self.cfg.max_units_per_step, allow_servers=allow_servers,
                                 frozen=self._idle_groups(obs))
        except Exception as e:  # a degenerate model must not take the job down: keep the plan
            return self._hold(f"search failed ({e!r}): keeping the plan", obs, action="fallback")
        if plan == obs.plan:
            moves, notes = [], []
        if not moves and notes and plan != obs.plan:
            self.last_change_s = obs.time_s
            if plan.servers != obs.plan.servers or plan.cpu_per_server != obs.plan.cpu_per_server:
                self.last_server_change_s = obs.time_s
            self._last_hold = ""
            return [Event("runtime", "rightsize", "; ".join(notes),
                          inputs={"worker_cpu_util": list(obs.worker_cpu_util),
                                  "server_cpu_util": [list(u) for u in obs.server_cpu_util],
                                  "worker_memory": list(obs.worker_memory), "server_memory": list(obs.server_memory)},
                          prediction={"samples_per_s_now": model.predict(obs.plan.allocation(self.job.host_cores)),
                                      "samples_per_s_after": model.predict(plan.allocation(self.job.host_cores))},
                          plan_before=obs.plan.to_dict(), plan_after=plan.to_dict(), time_s=obs.time_s)]
        if not moves:
            grow, shrink = best_moves(obs.plan, model, self.limits, self.cfg, self.job, self.memory,
                                      allow_servers=allow_servers, frozen=self._idle_groups(obs))
            why = (f"best growth {grow.action} has marginal ratio {grow.ratio:.2f} < {self.cfg.min_gain_ratio}"
                   if grow is not None else "no growth fits the limits")
            return self._hold(why, obs, prediction={"samples_per_s": model.predict(obs.plan.allocation(self.job.host_cores))})
        self.last_change_s = obs.time_s
        if any("server" in m.action for m in moves):
            self.last_server_change_s = obs.time_s
        self._last_hold = ""
        pred_now = model.predict(obs.plan.allocation(self.job.host_cores))
        pred_new = model.predict(plan.allocation(self.job.host_cores))
        return [Event("runtime", "+".join((["rightsize"] if notes else []) + [m.action for m in moves]),
                      ("; ".join(notes) + "; then " if notes else "") + f"{len(moves)} unit move(s), marginal ratios {[round(m.ratio, 3) for m in moves]} "
                      f"(threshold {self.cfg.min_gain_ratio} to grow, {self.cfg.shrink_ratio} to shrink)",
                      inputs={"observed_samples_per_s": obs.samples_per_s, "model_status": self.model.status,
                              "model": model.to_dict(), "samples": len(self.model.samples)},
                      prediction={"samples_per_s_now": pred_now, "samples_per_s_after": pred_new,
                                  "cost_now": _cost(obs.plan, self.cfg), "cost_after": _cost(plan, self.cfg)},
                      plan_before=obs.plan.to_dict(), plan_after=plan.to_dict(), time_s=obs.time_s)]

    def _idle_groups(self, obs: Observation) -> frozenset[str]:
        """Measured utilization beats the model: no more cores for pods that leave theirs idle."""
        out = set()
        if obs.worker_cpu_util and max(obs.worker_cpu_util) < self.cfg.low_util:
            out.add("add_cpu_per_worker")
        if any(len(x) for x in obs.server_cpu_util):
            if max(statistics.fmean(x) for x in obs.server_cpu_util if len(x)) < self.cfg.low_util:
                out.add("add_cpu_per_server")
        return frozenset(out)

    def _rightsize(self, obs: Observation, allow_servers: bool) -> tuple[JobPlan, list[str]]:
        """DLRover's utilization rules: CPU to what the pods use (+25%) when their peak use is low; worker
        memory to 1.5x the peak; server memory to 1.2x what the trend predicts at the end."""
        plan, cfg, lim, notes = obs.plan, self.cfg, self.limits, []
        if obs.worker_cpu_util:
            u = max(obs.worker_cpu_util)
            target = max(lim.min_cpu_per_worker, math.ceil(u * plan.cpu_per_worker * cfg.cpu_headroom))
            if u < cfg.low_util and target < plan.cpu_per_worker:
                notes.append(f"workers use at most {u:.0%} of {plan.cpu_per_worker:g} cores: {target:g} cores each")
                plan = replace(plan, cpu_per_worker=float(target))
        if allow_servers and plan.servers > 0 and obs.server_cpu_util:
            u = max(statistics.fmean(x) for x in obs.server_cpu_util if len(x)) if any(len(x) for x in obs.server_cpu_util) else 1.0
            target = max(1.0, math.ceil(u * plan.cpu_per_server * cfg.cpu_headroom))
            if u < cfg.low_util and target < plan.cpu_per_server:
                notes.append(f"servers use at most {u:.0%} of {plan.cpu_per_server:g} cores: {target:g} cores each")
                plan = replace(plan, cpu_per_server=float(target))
        if obs.worker_memory:
            need = max(lim.min_memory_per_pod, max(obs.worker_memory) * cfg.worker_memory_margin)
            if plan.memory_per_worker > 1.3 * need:
                notes.append(f"workers peak at {max(obs.worker_memory) / GiB:.2f} GiB: {need / GiB:.2f} GiB each")
                plan = replace(plan, memory_per_worker=need)
        if plan.servers > 0 and obs.server_memory and len(self._server_mem.points) >= 3:
            total = obs.total_steps if obs.total_steps is not None else _steps(self.job, plan)
            need = max(lim.min_memory_per_pod, self._server_mem.predicted_at(total) * cfg.memory_margin)
            if plan.memory_per_server > 1.3 * need:
                notes.append(f"servers predicted to peak at {need / cfg.memory_margin / GiB:.2f} GiB by the end: "
                             f"{need / GiB:.2f} GiB each")
                plan = replace(plan, memory_per_server=need)
        return plan, notes

    def _hold(self, reason: str, obs: Observation, action: str = "hold", prediction: dict | None = None) -> list[Event]:
        key = reason.split(":")[0] + action
        if key == self._last_hold:
            return []  # one event per kind of wait, not one per tick
        self._last_hold = key
        return [Event("runtime", action, reason, inputs={"observed_samples_per_s": obs.samples_per_s,
                                                         "model_status": self.model.status},
                      prediction=prediction or {}, plan_before=obs.plan.to_dict(), plan_after=None, time_s=obs.time_s)]


class InstabilityStage:
    """Stage 3: stragglers, hot servers / shards, memory exhaustion, pending pods."""

    def __init__(self, job: JobDescription, limits: JobLimits, cfg: OptimizerConfig = OptimizerConfig(),
                 memory: MemoryModel | None = None) -> None:
        self.job, self.limits, self.cfg, self.memory = job, limits, cfg, memory
        self.trends: dict[tuple[str, int], MemoryTrend] = {}
        self.pending_relaunches = 0
        self.last_migration_s: float | None = None

    def observe(self, obs: Observation) -> list[Event]:
        events: list[Event] = []
        plan = obs.plan
        # pending pods: nothing else matters until the job runs
        if obs.pending_s > self.cfg.pending_timeout_s:
            smaller = self._smaller(plan) if self.pending_relaunches < self.cfg.max_pending_relaunches else plan
            if smaller != plan:
                self.pending_relaunches += 1
                return [Event("instability", "relaunch_smaller",
                              f"pending {obs.pending_s:.0f}s > {self.cfg.pending_timeout_s:.0f}s: relaunch with half the resources",
                              inputs={"pending_s": obs.pending_s}, prediction={},
                              plan_before=plan.to_dict(), plan_after=smaller.to_dict(), time_s=obs.time_s)]
            return [Event("instability", "hold", f"pending {obs.pending_s:.0f}s; the plan is minimal or was already "
                          f"relaunched smaller {self.pending_relaunches} time(s) (max {self.cfg.max_pending_relaunches})",
                          inputs={"pending_s": obs.pending_s}, plan_before=plan.to_dict(), time_s=obs.time_s)]
        if obs.pending_s > 0:
            return []
        # memory: an OOM that happened, or one the trend / model predicts before the job ends
        need = self._memory_need(obs)
        if need is not None:
            events.append(need)
            plan = JobPlan.from_dict(need.plan_after)
        # stragglers
        times = [t for t in obs.worker_step_s if t and t > 0]
        if len(times) >= 2:
            med = statistics.median(times)
            # against the median of the *other* workers: with two workers the median of all is their mean,
            # which no step time can exceed twice
            slow = [i for i, t in enumerate(obs.worker_step_s) if t and t > self.cfg.straggler_factor * statistics.median(
                [u for j, u in enumerate(obs.worker_step_s) if j != i and u and u > 0] or [t])]
            if slow:
                events.append(Event("instability", "replace_straggler",
                                    f"worker(s) {slow} step time > {self.cfg.straggler_factor}x the median of the other "
                                    f"workers (all: {med:.3g}s): relaunch them on other nodes",
                                    inputs={"worker_step_s": list(obs.worker_step_s), "median_s": med},
                                    prediction={"samples_per_s_recovered_fraction": len(slow) / len(times)},
                                    plan_before=plan.to_dict(), plan_after=plan.to_dict(), time_s=obs.time_s))
        # hot servers / shards
        hot = []
        for i, util in enumerate(obs.server_cpu_util):
            recent = list(util)[-self.cfg.hot_samples:]
            if len(recent) >= self.cfg.hot_samples and statistics.fmean(recent) >= self.cfg.hot_cpu_util:
                hot.append(i)
        loads = [x for x in obs.shard_load if x is not None]
        hot_shards = []
        if len(loads) >= 2:
            med = statistics.median(loads)
            hot_shards = [i for i, x in enumerate(obs.shard_load) if med > 0 and x > self.cfg.hot_shard_factor * med]
        paced = self.last_migration_s is not None and obs.time_s - self.last_migration_s < self.cfg.server_interval_s
        if (hot or hot_shards) and plan.servers > 0 and not paced:
            self.last_migration_s = obs.time_s
            more = min(plan.cpu_per_server * 2, self.limits.max_cpu_per_server)
            new = replace(plan, cpu_per_server=more)
            if not self.limits.fits(new):
                new = plan
            events.append(Event("instability", "migrate_hot_server",
                                f"server(s) {sorted(set(hot + hot_shards))} hot (CPU >= {self.cfg.hot_cpu_util} over "
                                f"{self.cfg.hot_samples} samples, or load > {self.cfg.hot_shard_factor}x median): migrate to a pod "
                                f"with {more:g} cores" + ("" if new != plan else " (limits allow no more: migrate only)"),
                                inputs={"server_cpu_util": [list(u) for u in obs.server_cpu_util], "shard_load": list(obs.shard_load)},
                                prediction={}, plan_before=plan.to_dict(), plan_after=new.to_dict(), time_s=obs.time_s))
        elif hot_shards and not paced:
            self.last_migration_s = obs.time_s
            events.append(Event("instability", "rebalance_hot_shard",
                                f"embedding shard(s) {hot_shards} carry > {self.cfg.hot_shard_factor}x the median load: reshard",
                                inputs={"shard_load": list(obs.shard_load)}, plan_before=plan.to_dict(),
                                plan_after=plan.to_dict(), time_s=obs.time_s))
        return events

    def _smaller(self, plan: JobPlan) -> JobPlan:
        lim, floor = self.limits, self.limits.min_memory_per_pod
        if plan.workers > 1:
            return replace(plan, workers=max(1, plan.workers // 2))
        if plan.cpu_per_worker > lim.min_cpu_per_worker:
            return replace(plan, cpu_per_worker=max(lim.min_cpu_per_worker, math.floor(plan.cpu_per_worker / 2)),
                           memory_per_worker=max(floor, plan.memory_per_worker / 2))
        return plan

    def _memory_need(self, obs: Observation) -> Event | None:
        """Workers and servers alike: an OOM that happened, or one the trend / model predicts before the end."""
        plan, cfg = obs.plan, self.cfg
        total = obs.total_steps if obs.total_steps is not None else _steps(self.job, plan)
        remaining = max(total - obs.step, 0.0)
        groups = [("worker", "memory_per_worker", obs.worker_memory, obs.oom_workers)]
        if plan.servers > 0:
            groups.append(("server", "memory_per_server", obs.server_memory, obs.oom_servers))
        for group, _, rss_list, _ in groups:
            for i, rss in enumerate(rss_list):
                self.trends.setdefault((group, i), MemoryTrend()).add(obs.step, rss)
        for group, field_name, rss_list, oom in groups:
            limit = getattr(plan, field_name)
            reason, predicted = None, None
            hit = sorted(int(i) for i in oom)
            if hit:
                reason = f"{group}(s) {hit} ran out of memory at {limit / GiB:.2f} GiB"
                predicted = max(list(rss_list) + [limit]) * cfg.memory_margin
            else:
                for i in range(len(rss_list)):
                    tr = self.trends[(group, i)]
                    steps_left = tr.steps_to_exhaustion(limit)
                    if steps_left < remaining:
                        predicted = tr.predicted_at(total)
                        reason = (f"{group} {i} memory trend ({tr.slope():.3g} B/step) reaches its {limit / GiB:.2f} GiB "
                                  f"limit in {steps_left:.0f} steps, before the {remaining:.0f} steps left")
                        break
                if (reason is None and group == "worker" and self.memory is not None and self.job.table_bytes
                        and not self.job.parameter_server):
                    shard = embedding_shard_bytes(self.job.table_bytes, plan.workers)
                    if self.memory.will_oom(limit, shard, total / plan.workers):
                        predicted = self.memory.predict(shard, total / plan.workers)
                        reason = f"memory model predicts {predicted / GiB:.2f} GiB by step {total:.0f} > limit {limit / GiB:.2f} GiB"
            if reason is None:
                continue
            new_mem = next_memory(limit, needed_bytes=(predicted or 0) * cfg.memory_margin, max_step_bytes=cfg.oom_step_bytes,
                                  cap_bytes=min(cfg.memory_cap_bytes, self.limits.max_memory_per_pod))
            new = replace(plan, **{field_name: new_mem})
            inputs = {f"{group}_memory": list(rss_list), "step": obs.step, "total_steps": total, "limit_bytes": limit}
            # DLRover: an OOM relaunch is bounded per pod (+8 GiB a step, 64 GiB), not by the job's scaling limits
            if new_mem <= limit:
                return Event("instability", "memory_at_limit", reason + "; the pod is at the memory cap",
                             inputs=inputs, prediction={"peak_bytes": predicted},
                             plan_before=plan.to_dict(), plan_after=plan.to_dict(), time_s=obs.time_s)
            return Event("instability", f"relaunch_{group}s_more_memory",
                         reason + f": relaunch with {new_mem / GiB:.2f} GiB (double, at most +{cfg.oom_step_bytes / GiB:.0f} GiB)",
                         inputs=inputs, prediction={"peak_bytes": predicted}, plan_before=plan.to_dict(),
                         plan_after=new.to_dict(), time_s=obs.time_s)
        return None


# ---------------------------------------------------------------------------------------------
# the Policy
# ---------------------------------------------------------------------------------------------
class DLRoverPolicy:
    """`plan(job)` is stage 1; `runtime()` / `instability()` give the stage 2 and 3 objects for the
    same job; every decision is appended to `events`.

    JobInfo.extra may carry: dataset, model_family, batch_size, table_bytes (list), total_samples,
    memory_per_worker, host_cores, limits (a JobLimits or dict)."""

    def __init__(self, history: History | None = None, limits: JobLimits | None = None,
                 config: OptimizerConfig = OptimizerConfig(), default_model: ThroughputModel | None = None) -> None:
        self.history = history
        self.limits = limits
        self.config = config
        self.default_model = default_model
        self.events: list[Event] = []
        self.warm: WarmStart | None = None
        self.job: JobDescription | None = None
        self._restored = False

    @classmethod
    def from_stage1(cls, state: Mapping[str, Any], config: OptimizerConfig = OptimizerConfig()) -> "DLRoverPolicy":
        """The policy as the plan task left it (`pipeline_plan(...)["state"]`, JSON): `plan()` returns
        that plan without running stage 1 again. A state that cannot be read raises ValueError naming
        what is wrong (callers fall back to the plan without stages 2/3)."""
        try:
            j = state["job"]
            plan = JobPlan.from_dict(state["plan"])
            limits = JobLimits(**state["limits"])
            prior = ThroughputModel.from_dict(state["prior"]) if state.get("prior") else None
            memory = MemoryModel.from_dict(state["memory"]) if state.get("memory") else DEFAULT_MEMORY_MODEL
            job = JobDescription(str(j["dataset"]), str(j["model_family"]), plan, total_samples=float(j["total_samples"]),
                                 table_bytes=[float(b) for b in state.get("table_bytes") or []],
                                 host_cores=None if j.get("host_cores") is None else float(j["host_cores"]))
        except Exception as e:
            raise ValueError(f"DLRover stage 1 state unreadable ({type(e).__name__}: {e})") from e
        limits.check()
        policy = cls(limits=limits, config=config, default_model=prior)
        policy.job, policy.warm, policy._restored = job, WarmStart(plan, [], prior, memory), True
        return policy

    def describe(self, job: JobInfo) -> tuple[JobDescription, JobLimits]:
        x = dict(job.extra or {})
        r = job.resources
        batch = int(x.get("batch_size", max(1, job.rows_per_task)))
        requested = JobPlan(workers=r.workers, cpu_per_worker=float(r.threads_per_worker),
                            memory_per_worker=float(x.get("memory_per_worker", self.config.default_worker_memory)),
                            batch_size=batch)
        limits = x.get("limits", self.limits)
        if isinstance(limits, Mapping):
            limits = JobLimits(**limits)
        if limits is None:
            limits = JobLimits.of_this_machine()
        host = x.get("host_cores", float(os.cpu_count() or 1) if job.resources.backend == "local" else None)
        desc = JobDescription(dataset=str(x.get("dataset", "unknown")), model_family=str(x.get("model_family", "unknown")),
                              requested=requested, total_samples=float(x.get("total_samples", job.total_rows)),
                              table_bytes=list(x.get("table_bytes", ())), host_cores=host)
        return desc, limits

    def plan(self, job: JobInfo) -> ResourcePlan:
        if self._restored and self.warm is not None:
            return self.warm.plan.to_resource_plan()
        desc, limits = self.describe(job)
        self.job, self.limits = desc, limits
        self.warm = warm_start(desc, self.history, limits, self.config, self.default_model)
        self.events.extend(self.warm.events)
        return self.warm.plan.to_resource_plan()

    def runtime(self) -> RuntimeStage:
        self._need_plan()
        return RuntimeStage(self.job, self.limits, self.config, self.warm.prior, self.warm.memory,
                            terms=self.warm.prior.terms if self.warm.prior else None)

    def instability(self) -> InstabilityStage:
        self._need_plan()
        return InstabilityStage(self.job, self.limits, self.config, self.warm.memory)

    def _need_plan(self) -> None:
        if self.warm is None or self.job is None:
            raise RuntimeError("DLRoverPolicy: call plan(job) (stage 1) first")


# ---------------------------------------------------------------------------------------------
# our pipeline: stage 1 in the plan task, stages 2/3 as recommendations after the train task
# ---------------------------------------------------------------------------------------------
_LOCAL_MODEL: list = []


def local_default_model() -> ThroughputModel | None:
    """Our trainer's model fitted on the committed profile (elastic/optimizer/profiles/), the cold-start prior for
    the local backend; None (and a logged warning) when the profile is missing or cannot be fitted."""
    if not _LOCAL_MODEL:
        from recforge.elastic.optimizer.throughput_model import fit_profile, load_profile

        try:
            samples, _ = load_profile()
            _LOCAL_MODEL.append(fit_profile(samples).model)
        except Exception as e:  # documented fallback: no prior, the requested plan
            log.warning("no default resource model for the local trainer (%r): cold starts use the request", e)
            _LOCAL_MODEL.append(None)
    return _LOCAL_MODEL[0]


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


def optimizer_config(settings: Any = None) -> OptimizerConfig:
    """OptimizerConfig from the pipeline's resources.dlrover (recforge.config.DLRoverConfig); None: defaults."""
    if settings is None:
        return OptimizerConfig()
    return replace(OptimizerConfig(), profile_samples=int(settings.profile_samples),
                   interval_s=float(settings.change_interval_s), min_gain_ratio=float(settings.min_gain_ratio),
                   pending_timeout_s=float(settings.pending_timeout_s))


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
    info = JobInfo(shard_rows=[int(total_rows)], epochs=epochs, rows_per_task=batch_size, resources=resources, extra=extra)
    rp = policy.plan(info)
    w = policy.warm
    state = {"job": {"dataset": dataset, "model_family": model_family, "total_samples": float(total_rows) * epochs,
                     "host_cores": policy.job.host_cores, "batch_size": batch_size},
             "limits": dict(policy.limits.__dict__), "plan": w.plan.to_dict(),
             "prior": w.prior.to_dict() if w.prior is not None else None, "memory": w.memory.to_dict(),
             "table_bytes": list(policy.job.table_bytes)}
    return {"workers": rp.workers, "threads_per_worker": rp.threads_per_worker, "events": policy.events, "state": state}


def recommend_after_run(state: Mapping[str, Any], worker_result: Mapping[str, Any],
                        per_worker_samples: Mapping[str, float] | None = None,
                        cfg: OptimizerConfig = OptimizerConfig()) -> tuple[list[Event], ThroughputModel | None, JobPlan]:
    """Stages 2 and 3 on what a finished run measured (its throughput, and each worker's share of the
    samples from the job master). The run is one long profile, so stage 2 needs one sample and no
    pacing here. Returns the events (recommendations: nothing executes them), the job's model (the
    prior rescaled to the measurement, for the history) and the plan that ran."""
    j = state["job"]
    ran = replace(JobPlan.from_dict(state["plan"]), workers=int(worker_result.get("world_size", state["plan"]["workers"])),
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
    for e in events:
        e.reason += " [recommendation: not executed; the elastic runtime that applies plans is a separate issue]"
    return events, rt.model.model if rt.model.samples else None, ran
