"""Predicted iteration time of RAP and its baselines from stage profiles, the plan, the mapping and the cost model.

Work co-running in a stage is hidden up to the stage's spare capacity and the excess serializes; the iteration is
the slowest rank's. `METHODS` are RAP's end-to-end baselines and ablations (sequential, cuda_stream, mps,
rap_no_mapping, rap_no_fusion, rap, ideal). What each models: docs/rap.md#the-simulator.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from recforge.preprocess.planning.compiler import CompiledPlan, CompileMethod, FusedGroup, compile_plan
from recforge.preprocess.planning.graph import Node
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.milp import Placement, node_rows, rank_plan
from recforge.rap.planning.schedule import CorunSchedule, split_units
from recforge.rap.planning.scheduler import pack, schedule, select_stages
from recforge.rap.profiling.cost_model import predict_group
from recforge.rap.profiling.stages import STAGES

METHODS = ("sequential", "cuda_stream", "mps", "rap_no_mapping", "rap_no_fusion", "rap", "ideal")

# (compiled plan, group or part, rows of a node) -> ms of one launch
KernelCost = Callable[[CompiledPlan, FusedGroup, Callable[[Node], float]], float]


@dataclass(frozen=True)
class RankStages:
    duration_ms: Mapping[str, float]
    capacity_ms: Mapping[str, float]

    def __post_init__(self) -> None:
        missing = [s for s in STAGES if s not in self.duration_ms or s not in self.capacity_ms]
        if missing:
            raise ValueError(f"RankStages: stages {missing} lack a duration or a capacity")


@dataclass
class SimSetup:
    plan: Plan
    placements: Mapping[str, Placement]
    batch_size: int  # local
    ranks: Sequence[RankStages]  # one per rank: world_size = len(ranks)
    kernel_cost: KernelCost
    input_comm_ms: float = 0.0  # the ids' input all-to-all that RAP's mapping removes
    compile_method: CompileMethod = "greedy"

    @property
    def world_size(self) -> int:
        return len(self.ranks)


@dataclass
class MethodResult:
    iteration_ms: float
    rank_ms: list[float]
    prep_ms: list[float]  # preprocessing work per rank
    load_ms: list[dict[str, float]] = field(default_factory=list)  # per rank: work placed in each stage


@dataclass
class SimResult:
    methods: dict[str, MethodResult]
    schedules: list[CorunSchedule]  # RAP's, per rank

    def throughput_vs(self, base: str = "sequential") -> dict[str, float]:
        """Speedup of each method over `base` (iteration time ratio)."""
        b = self.methods[base].iteration_ms
        return {m: b / r.iteration_ms for m, r in self.methods.items()}


def _stage_time(rank: RankStages, load: Mapping[str, float]) -> float:
    return sum(rank.duration_ms[s] + max(0.0, load.get(s, 0.0) - rank.capacity_ms[s]) for s in STAGES)


def _group_cost(cost: KernelCost, compiled: CompiledPlan, rows: Callable[[Node], float]
                ) -> Callable[[FusedGroup], float]:
    """`cost` of a group of `compiled` with the rows bound: what the scheduler asks for."""
    return lambda group: cost(compiled, group, rows)


def _kernels(compiled: CompiledPlan, cost: KernelCost, rows: Callable[[Node], float], fused: bool
             ) -> tuple[list[int], Callable[[int, int, int], float]]:
    """Abstract kernels for scheduler.pack: fused groups (split units = nodes), or one kernel per node."""
    groups = compiled.groups if fused else [
        FusedGroup(layer=g.layer, op=g.op, cls=g.cls, nodes=(n,)) for g in compiled.groups for n in g.nodes]
    units = [len(split_units(compiled, g)) for g in groups]
    cache: dict = {}

    def part_cost(k: int, lo: int, hi: int) -> float:
        if (k, lo, hi) not in cache:
            g = groups[k]
            cache[(k, lo, hi)] = cost(compiled, FusedGroup(g.layer, g.op, g.cls, g.nodes[lo:hi]), rows)
        return cache[(k, lo, hi)]

    return units, part_cost


def _scheduled(rank: RankStages, units, part_cost) -> tuple[float, dict[str, float], float]:
    total = sum(part_cost(k, 0, u) for k, u in enumerate(units))
    taken, _ = select_stages(rank.duration_ms, rank.capacity_ms, total)
    load = {s: 0.0 for s in STAGES}
    for p in pack(units, part_cost, taken, rank.capacity_ms):
        load[p.stage] += p.ms
    return _stage_time(rank, load), load, total


def _ungated(rank: RankStages, work: float, spread: bool) -> tuple[float, dict[str, float]]:
    load = {s: 0.0 for s in STAGES}
    if spread:  # MPS: all step long, in proportion to stage time
        step = sum(rank.duration_ms.values())
        for s in STAGES:
            load[s] = work * rank.duration_ms[s] / step
        return _stage_time(rank, load), load
    left = work
    for s in STAGES:  # a side stream: from the start, as much as each stage lasts
        load[s] = min(left, rank.duration_ms[s])
        left -= load[s]
    return _stage_time(rank, load) + left, load


def simulate(setup: SimSetup) -> SimResult:
    w, b = setup.world_size, setup.batch_size
    every = {f: Placement("data_parallel", tuple(range(w))) for f in setup.plan.sparse_features()}
    local_plan = compile_plan(Plan(name=f"{setup.plan.name}@local", features=setup.plan.features),
                              method=setup.compile_method)
    local_rows = node_rows(local_plan.graph, every, b, w)
    res: dict[str, dict[str, list]] = {m: {"rank": [], "prep": [], "load": []} for m in METHODS}
    schedules = []

    def add(method: str, rank_ms: float, prep: float, load: Mapping[str, float] | None = None) -> None:
        res[method]["rank"].append(rank_ms)
        res[method]["prep"].append(prep)
        res[method]["load"].append(dict(load or {}))

    for r, rank in enumerate(setup.ranks):
        train = sum(rank.duration_ms.values())
        add("ideal", train, 0.0)
        units, cost = _kernels(local_plan, setup.kernel_cost, local_rows, fused=False)
        unfused_local = sum(cost(k, 0, u) for k, u in enumerate(units))
        add("sequential", train + unfused_local + setup.input_comm_ms, unfused_local)
        t, load = _ungated(rank, unfused_local, spread=False)
        add("cuda_stream", t + setup.input_comm_ms, unfused_local, load)
        t, load = _ungated(rank, unfused_local, spread=True)
        add("mps", t + setup.input_comm_ms, unfused_local, load)
        t, load, total = _scheduled(rank, *_kernels(local_plan, setup.kernel_cost, local_rows, fused=True))
        add("rap_no_mapping", t + setup.input_comm_ms, total, load)

        mine = compile_plan(rank_plan(setup.plan, setup.placements, r), method=setup.compile_method)
        rows = node_rows(mine.graph, setup.placements, b, w)
        t, load, total = _scheduled(rank, *_kernels(mine, setup.kernel_cost, rows, fused=False))
        add("rap_no_fusion", t, total, load)
        t, load, total = _scheduled(rank, *_kernels(mine, setup.kernel_cost, rows, fused=True))
        add("rap", t, total, load)
        schedules.append(schedule(mine, rank.duration_ms, rank.capacity_ms,
                                  _group_cost(setup.kernel_cost, mine, rows),
                                  meta={"rank": r, "world_size": w, "batch_size": b}))
    methods = {m: MethodResult(max(v["rank"]), v["rank"], v["prep"], v["load"]) for m, v in res.items()}
    return SimResult(methods, schedules)


def cost_model_kernel_cost(model, source_width: Mapping[str, float] | None = None) -> KernelCost:
    """KernelCost from a fitted recforge.rap.profiling.cost_model.CostModel."""
    return lambda compiled, group, rows: predict_group(model, compiled, group, rows, source_width)


def corun_thread_iteration_ms(duration_ms: Mapping[str, float], capacity_ms: Mapping[str, float], work_ms: float,
                              start: str = STAGES[0]) -> float:
    """Iteration time when all of `work_ms` starts at stage `start` on a co-run thread of its own (CPU): the work is
    not confined to a stage, it runs on through the later ones, so it is hidden up to the capacity of `start` and
    every stage after it and the rest serializes (RAP's stage model summed over the stages it spans)."""
    spans = STAGES[STAGES.index(start):]
    return sum(duration_ms[s] for s in STAGES) + max(0.0, work_ms - sum(capacity_ms[s] for s in spans))

