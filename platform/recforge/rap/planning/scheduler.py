"""RAP's co-run scheduler (§3.4): greedy fill of the training stages' spare capacity, splitting fused kernels.

Stages are taken by capacity per unit of time until they cover the predicted kernel time, then filled with the
kernels in execution order; a kernel that does not fit is split at the capacity edge (every split size tried).
`mapped_rank_schedules` does this for both jobs of a mapped rank. Design: docs/rap.md#the-scheduler.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recforge.preprocess.planning.compiler import CompiledPlan, CompileMethod, FusedGroup, compile_plan
from recforge.preprocess.planning.graph import Node
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.milp import Placement, node_rows, rank_plan, split_rank_plan
from recforge.rap.planning.schedule import Assignment, CorunSchedule, split_units
from recforge.rap.profiling.cost_model import CostModel, predict_group
from recforge.rap.profiling.stages import STAGES

PartCost = Callable[[int, int, int], float]  # (kernel index, first unit, end unit) -> ms


@dataclass(frozen=True)
class Placed:
    stage: str
    kernel: int
    lo: int
    hi: int  # units [lo, hi) of the kernel
    ms: float


def rank_stages(duration_ms: Mapping[str, float], capacity_ms: Mapping[str, float]) -> list[str]:
    """Stages by capacity intensity, highest first; ties in execution order."""
    def intensity(s: str) -> float:
        d, c = duration_ms[s], capacity_ms[s]
        return c / d if d > 0 else (float("inf") if c > 0 else 0.0)

    order = [s for s in STAGES if s in duration_ms]
    return sorted(order, key=lambda s: -intensity(s))


def select_stages(duration_ms: Mapping[str, float], capacity_ms: Mapping[str, float], total_ms: float
                  ) -> tuple[list[str], bool]:
    """(taken stages in execution order, overflow: all capacity is less than total_ms)."""
    taken: list[str] = []
    cap = 0.0
    for s in rank_stages(duration_ms, capacity_ms):
        if cap >= total_ms and taken:
            break
        taken.append(s)
        cap += capacity_ms[s]
    return [s for s in STAGES if s in taken], cap < total_ms


def pack(units: Sequence[int], cost: PartCost, stages: Sequence[str], capacity_ms: Mapping[str, float]
         ) -> list[Placed]:
    """Steps 3-4 over abstract kernels: `units[k]` split units of kernel k, in execution order."""
    placed: list[Placed] = []
    queue = [(k, 0) for k in range(len(units)) if units[k] > 0]  # (kernel, first unit not yet placed)
    for stage in stages:
        left = capacity_ms[stage]
        while queue:
            k, lo = queue[0]
            whole = cost(k, lo, units[k])
            if whole <= left:
                placed.append(Placed(stage, k, lo, units[k], whole))
                left -= whole
                queue.pop(0)
                continue
            fits = [(hi, c) for hi in range(lo + 1, units[k]) if (c := cost(k, lo, hi)) <= left]
            if fits:
                hi, c = max(fits)
                placed.append(Placed(stage, k, lo, hi, c))
                queue[0] = (k, hi)
            break
    last = stages[-1] if stages else STAGES[-1]
    placed.extend(Placed(last, k, lo, units[k], cost(k, lo, units[k])) for k, lo in queue)
    return placed


def group_cost(model: CostModel, compiled: CompiledPlan, rows: float | Callable[[Node], float],
               source_width: Mapping[str, float] | None = None) -> Callable[[FusedGroup], float]:
    """ms of a fused group or part; `rows` as in cost_model.predict_group (recforge.rap.mapping.milp.node_rows gives
    a worker's: local batch for dense / data-parallel features, global batch for the tables it holds)."""
    return lambda g: predict_group(model, compiled, g, rows, source_width)


def schedule(compiled: CompiledPlan, duration_ms: Mapping[str, float], capacity_ms: Mapping[str, float],
             cost: Callable[[FusedGroup], float], meta: Mapping[str, Any] | None = None) -> CorunSchedule:
    """The co-run schedule of every fused group of `compiled` (one worker's plan)."""
    missing = [s for s in STAGES if s not in duration_ms or s not in capacity_ms]
    if missing:
        raise ValueError(f"schedule: stages {missing} have no duration / capacity in the profile")
    groups = compiled.groups
    units = [split_units(compiled, g) for g in groups]

    def part(k: int, lo: int, hi: int) -> FusedGroup:
        g = groups[k]
        return FusedGroup(layer=g.layer, op=g.op, cls=g.cls, nodes=g.nodes[lo:hi])

    cache: dict[tuple[int, int, int], float] = {}

    def part_cost(k: int, lo: int, hi: int) -> float:
        if (k, lo, hi) not in cache:
            cache[(k, lo, hi)] = float(cost(part(k, lo, hi)))
        return cache[(k, lo, hi)]

    total = sum(part_cost(k, 0, len(u)) for k, u in enumerate(units))
    taken, overflow = select_stages(duration_ms, capacity_ms, total)
    placed = pack([len(u) for u in units], part_cost, taken, capacity_ms)
    assignments = [Assignment(stage=p.stage, group=groups[p.kernel].name,
                              features=tuple(f for unit in units[p.kernel][p.lo:p.hi] for f in unit),
                              predicted_ms=p.ms) for p in placed]
    load = {s: 0.0 for s in STAGES}
    for a in assignments:
        load[a.stage] += a.predicted_ms
    info = {
        "total_predicted_ms": total, "taken_stages": taken, "overflow": overflow,
        "stage_ms": dict(duration_ms), "capacity_ms": dict(capacity_ms), "load_ms": load,
        "unhidden_ms": sum(max(0.0, load[s] - capacity_ms[s]) for s in STAGES),
        "split_kernels": len({p.kernel for p in placed if (p.lo, p.hi) != (0, len(units[p.kernel]))}),
    }
    sched = CorunSchedule(stages=STAGES, assignments=assignments, plan_name=compiled.plan.name,
                          meta={**info, **dict(meta or {})})
    sched.validate(compiled)
    return sched



def rank_schedule(plan: Plan, placements: Mapping[str, Placement], rank: int, world_size: int, batch_size: int,
                  duration_ms: Mapping[str, float], capacity_ms: Mapping[str, float], model: CostModel,
                  source_width: Mapping[str, float] | None = None, method: CompileMethod = "greedy",
                  ) -> tuple[CompiledPlan, CorunSchedule]:
    """One worker's compiled plan (recforge.rap.mapping.milp.rank_plan: dense + data-parallel features over the local
    batch, its tables over the global batch) and its co-run schedule. Build the worker's FusedExecutor from this
    compiled plan: the schedule names its groups."""
    mine = compile_plan(rank_plan(plan, placements, rank), method=method)
    rows = node_rows(mine.graph, placements, batch_size, world_size)
    sched = schedule(mine, duration_ms, capacity_ms, group_cost(model, mine, rows, source_width),
                     meta={"rank": rank, "world_size": world_size, "batch_size": batch_size})
    return mine, sched


CostOf = Callable[[CompiledPlan, int], Callable[[FusedGroup], float]]  # (compiled, rows) -> a group's ms


def mapped_rank_schedules(plan: Plan, placements: Mapping[str, Placement], rank: int, world_size: int,
                          batch_size: int, duration_ms: Mapping[str, float], capacity_ms: Mapping[str, float],
                          cost_of: CostOf, method: CompileMethod = "greedy",
                          ) -> list[tuple[CompiledPlan, CorunSchedule]]:
    """RAP's mapping as co-run jobs of `rank`: [(compiled, schedule)] of its global job (the tables it holds
    table_wise / column_wise, over the global batch: world_size * batch_size rows) and then its local job
    (dense features and data_parallel tables, over its batch_size rows), each present only when it has a feature
    (recforge.rap.mapping.milp.split_rank_plan); [] when the rank preprocesses nothing. Run them with
    CorunRuntime(jobs=...) in this order (build each job's FusedExecutor from its compiled plan: the schedule
    names its groups).

    The global job is scheduled first into the stages' spare capacity, with its groups' costs at the global rows
    (`cost_of(compiled, rows)`: e.g. group_cost(model, compiled, rows) or a timer); the local job then gets the
    capacity the global job left, max(0, capacity - global load) per stage, at the local rows. So the two loads
    in a stage stay within its capacity except where a job's leftovers went into its last taken stage (§3.4 step
    4). Each schedule's meta: job ('global' / 'local'), rows, rank, world_size, batch_size, stage_capacity_ms (the
    stage's whole capacity; `capacity_ms` is what that job was given)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"mapped_rank_schedules: rank {rank} is not in [0, world_size={world_size})")
    if batch_size < 1:
        raise ValueError(f"mapped_rank_schedules: batch_size must be >= 1, got {batch_size}")
    local, global_ = split_rank_plan(plan, placements, rank)
    left = dict(capacity_ms)
    out = []
    for job, sub, rows in (("global", global_, world_size * batch_size), ("local", local, batch_size)):
        if sub is None:
            continue
        compiled = compile_plan(sub, method=method)
        sched = schedule(compiled, duration_ms, left, cost_of(compiled, rows),
                         meta={"job": job, "rows": rows, "rank": rank, "world_size": world_size,
                               "batch_size": batch_size, "stage_capacity_ms": dict(capacity_ms)})
        load = sched.predicted_ms_by_stage()
        left = {s: max(0.0, left[s] - load.get(s, 0.0)) for s in left}
        out.append((compiled, sched))
    return out
