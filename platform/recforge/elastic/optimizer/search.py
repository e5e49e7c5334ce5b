"""The greedy marginal-gain search that stages 1 and 2 share (DLRover-RM): from a plan, take the unit
move with the best predicted throughput gain per unit of added cost while the marginal ratio
(dTheta/dcost) / (Theta/cost) holds, or give back units whose removal costs little; `clamp` fits a plan
into the job's limits."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from recforge.elastic.optimizer.models.memory_model import GiB, MemoryModel, embedding_shard_bytes
from recforge.elastic.optimizer.models.throughput_model import ROW_TERMS, ThroughputModel
from recforge.elastic.optimizer.plans import JobDescription, JobLimits, OptimizerConfig, PodPlan, ResourceLimitError


@dataclass
class Move:
    """One unit change of a plan with its predicted effect."""

    action: str
    plan: PodPlan
    gain: float        # predicted samples/s change (negative for a shrink)
    cost: float        # added core-equivalents (negative for a shrink)
    ratio: float       # (gain / cost) / (throughput / total cost)


def plan_cost(plan: PodPlan, cfg: OptimizerConfig) -> float:
    """The plan's cost in core-equivalents (memory counted as `cfg.gib_per_core` GiB per core)."""
    return plan.cpu_total + plan.memory_total / GiB / cfg.gib_per_core


_NAMES = {True: ("add_worker", "add_cpu_per_worker", "add_server", "add_cpu_per_server"),
          False: ("remove_worker", "remove_cpu_per_worker", "remove_server", "remove_cpu_per_server")}


def candidates(plan: PodPlan, grow: bool, ps: bool) -> list[tuple[str, PodPlan]]:
    """The unit moves from `plan` (add or remove one worker, server or core per pod), named by action; a move
    that would leave a count below 1 is not one."""
    d = 1 if grow else -1
    names = _NAMES[grow]
    w, c, m, b = plan.workers, plan.cpu_per_worker, plan.memory_per_worker, plan.batch_size
    sv, cs, ms = plan.servers, plan.cpu_per_server, plan.memory_per_server
    out = []
    if w + d >= 1:
        out.append((names[0], _plan(w + d, c, m, b, sv, cs, ms)))
    if c + d >= 1:
        out.append((names[1], _plan(w, c + d, m, b, sv, cs, ms)))
    if ps:
        if sv + d >= 1:
            out.append((names[2], _plan(w, c, m, b, sv + d, cs, ms)))
        if cs + d >= 1:
            out.append((names[3], _plan(w, c, m, b, sv, cs + d, ms)))
    return out


_new = object.__new__


def _plan(w: int, c: float, m: float, b: int, sv: int, cs: float, ms: float) -> PodPlan:
    """PodPlan(w, c, m, b, sv, cs, ms) for the search's inner loop: the same fields and the same check as its
    __init__ / __post_init__, written into the instance's __dict__ (a frozen dataclass's __init__ sets each field
    through object.__setattr__, a third of the search's plan building)."""
    if w < 1 or c <= 0 or m <= 0:
        return PodPlan(w, c, m, b, sv, cs, ms)  # (raises PodPlan's own error)
    p = _new(PodPlan)
    p.__dict__.update(workers=w, cpu_per_worker=c, memory_per_worker=m, batch_size=b, servers=sv, cpu_per_server=cs,
                      memory_per_server=ms)
    return p


def memory_for(plan: PodPlan, job: JobDescription, mem: MemoryModel, cfg: OptimizerConfig, floor: float) -> PodPlan:
    """Worker memory follows the worker count: the embedding shard shrinks as workers are added."""
    if job.parameter_server or not job.table_bytes:
        return plan
    # the memory model counts per-worker steps
    need = mem.required_bytes(embedding_shard_bytes(job.table_bytes, plan.workers),
                              job_steps(job, plan) / plan.workers, cfg.memory_margin)
    return _with(plan, memory_per_worker=max(floor, need))


def pod_memory_at(memory: float, job: JobDescription, workers_then: int, workers_now: int, *,
                  emb_factor: float = 1.0, margin: float = 1.0) -> float:
    """A worker pod's memory (or a measured peak, with `margin` 1) at `workers_then` workers, converted to
    `workers_now`: the embedding shard it holds changes with the worker count (the tables are sharded over the
    workers). A smaller shard takes off only its own bytes (the weights are resident at least once); a larger
    one adds its growth x `emb_factor` (weights and optimizer state) x `margin`. Unchanged without tables, for a
    parameter-server job (its workers hold no shard) or at the same count."""
    if job.parameter_server or not job.table_bytes or workers_then == workers_now:
        return memory
    delta = (embedding_shard_bytes(job.table_bytes, max(workers_now, 1))
             - embedding_shard_bytes(job.table_bytes, max(workers_then, 1)))
    return max(memory + delta * (max(emb_factor, 1.0) * margin if delta > 0 else 1.0), 0.0)


def _with(plan: PodPlan, **change: Any) -> PodPlan:
    """dataclasses.replace for the search's inner loop (the same fields through __init__, without its
    per-call field introspection)."""
    d = {**plan.__dict__, **change}
    return _plan(d["workers"], d["cpu_per_worker"], d["memory_per_worker"], d["batch_size"], d["servers"],
                 d["cpu_per_server"], d["memory_per_server"])


def _row(plan: PodPlan, host: float | None) -> tuple[float, float, float, float, float, float]:
    """`row_values(plan.allocation(host))` without building the Allocation (the search scores ~5 plans a move)."""
    return (float(plan.workers), float(plan.cpu_per_worker), float(plan.batch_size), float(max(plan.servers, 0)),
            float(plan.cpu_per_server) if plan.servers else 1.0, float(host) if host else math.inf)


def job_steps(job: JobDescription, plan: PodPlan) -> float:
    """The job's total in batches of the whole job (Observation.step counts these), whatever the worker count."""
    return job.total_samples / max(plan.batch_size, 1)


def best_moves(plan: PodPlan, model: ThroughputModel, limits: JobLimits, cfg: OptimizerConfig, job: JobDescription,
               mem: MemoryModel | None = None, *, allow_servers: bool = True,
               frozen: frozenset[str] = frozenset()) -> tuple[Move | None, Move | None]:
    """The best growing move and the cheapest shrinking move (by predicted marginal ratio); actions in
    `frozen` are not considered."""
    host = job.host_cores
    cands: list[tuple[bool, str, PodPlan]] = []
    for is_grow in (True, False):
        for action, p in candidates(plan, is_grow, job.parameter_server and allow_servers):
            if action in frozen:
                continue
            if mem is not None:
                p = memory_for(p, job, mem, cfg, limits.min_memory_per_pod)
            if is_grow and not limits.fits(p):
                continue
            cands.append((is_grow, action, p))
    thr = model.predict_rows([_row(plan, host)] + [_row(p, host) for _, _, p in cands])
    base, base_cost = thr[0], plan_cost(plan, cfg)
    avg = base / base_cost
    grow, shrink = None, None  # (index into cands, gain, cost, ratio) of the best so far
    for i, t in enumerate(thr[1:]):
        is_grow, p = cands[i][0], cands[i][2]
        gain = t - base
        cost = plan_cost(p, cfg) - base_cost
        if cost == 0:
            continue
        # for a shrink gain<0 and cost<0: the ratio is the throughput lost per unit saved
        ratio = (gain / cost) / avg if avg > 0 else 0.0
        if is_grow and (grow is None or ratio > grow[3]):
            grow = (i, gain, cost, ratio)
        if not is_grow and (shrink is None or ratio < shrink[3]):
            shrink = (i, gain, cost, ratio)
    return ((Move(cands[grow[0]][1], cands[grow[0]][2], *grow[1:]) if grow is not None else None),
            (Move(cands[shrink[0]][1], cands[shrink[0]][2], *shrink[1:]) if shrink is not None else None))


def search(plan: PodPlan, model: ThroughputModel, limits: JobLimits, cfg: OptimizerConfig, job: JobDescription,
           mem: MemoryModel | None = None, *, max_units: int | None = None, allow_servers: bool = True,
           frozen: frozenset[str] = frozenset(),
           first: tuple[Move | None, Move | None] | None = None) -> tuple[PodPlan, list[Move]]:
    """Greedy marginal-gain search from `plan`: grow while the ratio holds, else shrink while it is cheap.
    `first`: `best_moves` from `plan` with these arguments, when the caller already has it (not computed again)."""
    moves: list[Move] = []
    limit = max_units if max_units is not None else 10_000
    while len(moves) < limit:
        if first is not None:
            (grow, shrink), first = first, None
        else:
            grow, shrink = best_moves(plan, model, limits, cfg, job, mem, allow_servers=allow_servers, frozen=frozen)
        if grow is not None and grow.ratio >= cfg.min_gain_ratio and grow.gain > 0:
            if moves and moves[-1].action.startswith("remove"):
                break  # never undo a shrink in the same search
            moves.append(grow)
            plan = grow.plan
        elif (shrink is not None and shrink.ratio < cfg.shrink_ratio
              and (not moves or moves[-1].action.startswith("remove"))):
            moves.append(shrink)
            plan = shrink.plan
        else:
            break
    return plan, moves


# the model's terms in which every core of a worker computes (the rest of a step: one core, or waiting)
ALL_CORE_TERMS = frozenset({"b_per_cpu", "b_per_cpu_oversub"})
ONE_CORE_TERMS = frozenset({"b", "b_oversub"})


def predicted_worker_util(plan: PodPlan, model: ThroughputModel, host: float | None = None) -> float | None:
    """The share of a worker's cores the model expects busy: the step time of its compute terms (all cores for
    those that threads parallelise, one core for per-sample serial work) over the whole step time and cores.
    None when the model has no compute term or predicts no step time."""
    row = _row(plan, host)
    total = busy = 0.0
    for t, k in zip(model.terms, model.coef, strict=True):
        v = k * ROW_TERMS[t](*row)
        total += v
        if t in ALL_CORE_TERMS:
            busy += v * plan.cpu_per_worker
        elif t in ONE_CORE_TERMS:
            busy += v
    if not (total > 0 and busy > 0 and math.isfinite(total)):
        return None
    return min(1.0, busy / (total * plan.cpu_per_worker))


def rightsize_predicted(plan: PodPlan, model: ThroughputModel, limits: JobLimits, cfg: OptimizerConfig,
                        host: float | None = None) -> tuple[PodPlan, float | None]:
    """Stage 2's CPU right-sizing rule (cores = ceil(used x `cpu_headroom`) while the utilization is below
    `low_util`) applied to the model's predicted utilization until it stops: the cores per worker stage 2
    would right-size a new plan to once it measures it (each of its right-sizings is a relaunch). Returns the
    plan and the predicted utilization it ends at (None: the model cannot tell; the plan is unchanged)."""
    u = predicted_worker_util(plan, model, host)
    for _ in range(64):
        if u is None or u >= cfg.low_util:
            break
        c = plan.cpu_per_worker
        target = max(limits.min_cpu_per_worker, float(math.ceil(u * c * cfg.cpu_headroom)))
        if target >= c:
            break
        nxt = _with(plan, cpu_per_worker=target)
        u_next = predicted_worker_util(nxt, model, host)
        if u_next is None:
            break
        plan, u = nxt, u_next
    return plan, u


def clamp(plan: PodPlan, limits: JobLimits) -> PodPlan:
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
            p = replace(p, memory_per_worker=max(limits.min_memory_per_pod,
                                                 min(limits.memory, p.memory_per_worker / 2)))
        elif p.servers > 1:
            p = replace(p, servers=p.servers - 1)
        elif p.cpu_per_server > 1:
            p = replace(p, cpu_per_server=p.cpu_per_server - 1)
        elif p.memory_per_server > limits.min_memory_per_pod:
            p = replace(p, memory_per_server=max(limits.min_memory_per_pod, p.memory_per_server / 2))
        else:
            raise ResourceLimitError(f"limits {limits} cannot hold the minimal plan {p.to_dict()}")
    return p
