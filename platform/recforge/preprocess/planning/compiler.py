"""Plan compiler: op DAG -> layers -> horizontally fused groups (RAP §3.2).

Every node gets a layer l in [0, L) with layer(child) >= layer(parent) + 1; the nodes of one type (op and batch
class) in one layer form one fused group, run as one kernel launch. RAP picks layers to maximize
sum over types t and layers l of n_{t,l}^2 (n = nodes of type t in layer l), so same-type ops share launches.
`layers_milp` solves that with scipy.optimize.milp (HiGHS), see milp.py; `layers_greedy` puts every node at its
depth, which is what RAP's solver finds for chain-shaped plans.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

from recforge.preprocess.planning.graph import BatchClass, OpGraph, build_graph
from recforge.preprocess.planning.plan import Plan

CompileMethod = Literal["milp", "greedy"]  # RAP's layer assignment (MILP), or grouping by depth

DEFAULT_LAYERS = 8  # RAP's L


@dataclass(frozen=True)
class FusedGroup:
    layer: int
    op: str
    cls: BatchClass
    nodes: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"L{self.layer}:{self.op}_{self.cls}x{len(self.nodes)}"


@dataclass
class CompiledPlan:
    plan: Plan
    graph: OpGraph
    layer_of: dict[int, int]
    groups: list[FusedGroup]  # execution order: by layer, then class, then op
    method: CompileMethod
    objective: int
    solve_time_s: float
    solver_status: str = "n/a"
    info: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """What gets logged (MLflow params / artifacts): method, objective, and every group."""
        return {
            "plan": self.plan.name,
            "method": self.method,
            "objective": self.objective,
            "solve_time_s": round(self.solve_time_s, 4),
            "solver_status": self.solver_status,
            "graph": self.graph.summary(),
            "launches": len(self.groups),
            "groups": [g.name for g in self.groups],
            **self.info,
        }


def objective(graph: OpGraph, layer_of: dict[int, int]) -> int:
    """RAP's fusion objective: sum over (type, layer) of the squared group size."""
    counts: dict[tuple[str, int], int] = defaultdict(int)
    for n in graph.nodes:
        counts[(n.type, layer_of[n.id])] += 1
    return sum(c * c for c in counts.values())


def check_layers(graph: OpGraph, layer_of: dict[int, int], num_layers: int | None = None) -> None:
    """Raise ValueError unless every node has a layer, inside [0, L), after its parent's."""
    for n in graph.nodes:
        if n.id not in layer_of:
            raise ValueError(f"node {n.id} ({n.type}) has no layer")
        if layer_of[n.id] < 0 or (num_layers is not None and layer_of[n.id] >= num_layers):
            raise ValueError(f"node {n.id} ({n.type}) is in layer {layer_of[n.id]}, outside [0, {num_layers})")
        if n.parent is not None and layer_of[n.id] <= layer_of[n.parent]:
            raise ValueError(f"node {n.id} ({n.type}) is not after its parent {n.parent}")


def groups_of(graph: OpGraph, layer_of: dict[int, int]) -> list[FusedGroup]:
    by_key: dict[tuple[int, BatchClass, str], list[int]] = defaultdict(list)
    for n in graph.nodes:
        by_key[(layer_of[n.id], n.cls, n.op)].append(n.id)
    return [FusedGroup(layer=layer, op=op, cls=cls, nodes=tuple(ids))
            for (layer, cls, op), ids in sorted(by_key.items())]


def layers_greedy(graph: OpGraph) -> dict[int, int]:
    """Every node at its depth: groups are (op type, class, depth)."""
    return {n.id: n.depth for n in graph.nodes}


def num_layers_for(graph: OpGraph, layers: int = DEFAULT_LAYERS) -> int:
    """RAP's L = 8, or the longest chain when that is longer."""
    longest = max((n.depth + 1 for n in graph.nodes), default=1)
    return max(layers, longest)


def compile_plan(
    plan: Plan, method: CompileMethod = "milp", layers: int = DEFAULT_LAYERS, time_limit_s: float = 30.0,
) -> CompiledPlan:
    """Build the DAG and assign layers; `method` "milp" is RAP's layer assignment, "greedy" groups by depth."""
    graph = build_graph(plan)
    t0 = time.perf_counter()
    status, info = "n/a", {}
    if method == "greedy":
        layer_of = layers_greedy(graph)
    elif method == "milp":
        from recforge.preprocess.planning.milp import layers_milp  # lazy: scipy; the plan stage's path stays light

        result = layers_milp(graph, num_layers_for(graph, layers), time_limit_s=time_limit_s)
        layer_of, status, info = result.layer_of, result.status, result.info
    else:
        raise ValueError(f"compile_plan: method must be 'milp' or 'greedy', got {method!r}")
    elapsed = time.perf_counter() - t0
    check_layers(graph, layer_of)
    return CompiledPlan(plan=plan, graph=graph, layer_of=layer_of, groups=groups_of(graph, layer_of),
                        method=method, objective=objective(graph, layer_of), solve_time_s=elapsed,
                        solver_status=status, info=info)
