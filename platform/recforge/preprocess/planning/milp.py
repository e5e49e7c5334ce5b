"""RAP's layer assignment as a mixed-integer linear program, solved by HiGHS through scipy.optimize.milp.

Maximizes the sum over op type t and layer l of n_{t,l}^2 (RAP's objective: same-type ops share fused launches),
one layer per node, each after its parent. Identical trees are solved once, the square is linearized exactly, and
a tie-break picks the optimum with the earliest layers.
Design: docs/rap.md#the-fusion-milp-and-the-fused-executor.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from recforge.preprocess.planning.graph import OpGraph


@dataclass
class MilpResult:
    layer_of: dict[int, int]
    status: str
    info: dict[str, Any] = field(default_factory=dict)


def _tree_keys(graph: OpGraph) -> dict[int, tuple]:
    """A canonical key per node: its type and the sorted keys of its children (equal keys = isomorphic)."""
    keys: dict[int, tuple] = {}
    for n in reversed(graph.nodes):  # children come after their parent
        keys[n.id] = (n.type, tuple(sorted(keys[c] for c in graph.children.get(n.id, []))))
    return keys


def _match(graph: OpGraph, keys: dict[int, tuple], rep: int, copy: int, into: dict[int, int]) -> None:
    """Map the nodes of tree `copy` onto the isomorphic tree `rep` (children matched in key order)."""
    into[copy] = rep
    a = sorted(graph.children.get(rep, []), key=lambda c: keys[c])
    b = sorted(graph.children.get(copy, []), key=lambda c: keys[c])
    for r, c in zip(a, b, strict=True):
        _match(graph, keys, r, c, into)


def _subtree(graph: OpGraph, root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(graph.children.get(n, []))
    return sorted(out)


def layers_milp(graph: OpGraph, num_layers: int, time_limit_s: float = 30.0) -> MilpResult:
    keys = _tree_keys(graph)
    templates: dict[tuple, list[int]] = defaultdict(list)
    for r in graph.roots():
        templates[keys[r]].append(r)
    rep_of: dict[int, int] = {}
    weight: dict[int, int] = {}
    rep_nodes: list[int] = []
    for roots in templates.values():
        members = _subtree(graph, roots[0])
        rep_nodes += members
        for v in members:
            weight[v] = len(roots)
        for r in roots:
            _match(graph, keys, roots[0], r, rep_of)

    node = {n.id: n for n in graph.nodes}
    L = num_layers
    heights = {v: graph.height(v) for v in rep_nodes}
    feasible = {v: range(node[v].depth, L - heights[v]) for v in rep_nodes}
    if any(len(r) == 0 for r in feasible.values()):
        raise ValueError(f"layers_milp: a chain is longer than the {L} layers")

    col: dict[tuple[int, int], int] = {}
    for v in rep_nodes:
        for layer in feasible[v]:
            col[(v, layer)] = len(col)
    n_x = len(col)
    ancestors: dict[int, set[int]] = {}
    for v in rep_nodes:  # nodes are in topological order within each subtree
        p = node[v].parent
        ancestors[v] = (ancestors[p] | {p}) if p is not None else set()
    by_type: dict[str, list[int]] = defaultdict(list)
    for v in rep_nodes:
        by_type[node[v].type].append(v)
    pairs: list[tuple[int, int, int]] = []  # (u, v, layer) with a product variable
    for members in by_type.values():
        for i, u in enumerate(members):
            for v in members[i + 1:]:
                if u in ancestors[v] or v in ancestors[u]:
                    continue
                for layer in feasible[u]:
                    if layer in feasible[v]:
                        pairs.append((u, v, layer))
    n_var = n_x + len(pairs)

    total_weight = sum(weight[v] for v in rep_nodes)
    eps = 1.0 / (total_weight * L + 1)
    gain = np.zeros(n_var)
    for (v, layer), j in col.items():
        gain[j] = weight[v] ** 2 - eps * weight[v] * layer
    for k, (u, v, _) in enumerate(pairs):
        gain[n_x + k] = 2 * weight[u] * weight[v]

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def add_row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        r = len(lo)
        for j, a in entries:
            rows.append(r)
            cols.append(j)
            vals.append(a)
        lo.append(lb)
        hi.append(ub)

    for v in rep_nodes:  # one layer per node
        add_row([(col[(v, layer)], 1.0) for layer in feasible[v]], 1, 1)
    for v in rep_nodes:  # after the parent
        p = node[v].parent
        if p is not None:
            add_row([(col[(v, layer)], float(layer)) for layer in feasible[v]]
                    + [(col[(p, layer)], -float(layer)) for layer in feasible[p]], 1, np.inf)
    for k, (u, v, layer) in enumerate(pairs):  # y <= x_u, y <= x_v
        add_row([(n_x + k, 1.0), (col[(u, layer)], -1.0)], -np.inf, 0)
        add_row([(n_x + k, 1.0), (col[(v, layer)], -1.0)], -np.inf, 0)

    a = coo_matrix((vals, (rows, cols)), shape=(len(lo), n_var)).tocsr()
    integrality = np.concatenate([np.ones(n_x), np.zeros(len(pairs))])
    res = milp(
        c=-gain, integrality=integrality, bounds=Bounds(0, 1), constraints=LinearConstraint(a, lo, hi),
        options={"time_limit": time_limit_s, "mip_rel_gap": 0.0, "presolve": True},
    )
    if res.x is None:
        raise RuntimeError(f"layers_milp: HiGHS found no assignment ({res.message})")
    rep_layer = {}
    for v in rep_nodes:
        rep_layer[v] = max(feasible[v], key=lambda layer: res.x[col[(v, layer)]])
    layer_of = {n.id: rep_layer[rep_of[n.id]] for n in graph.nodes}
    status = "optimal" if res.status == 0 else f"status {res.status}: {res.message}"
    info = {"templates": len(templates), "variables": n_var, "binaries": n_x, "constraints": len(lo),
            "num_layers": L, "mip_gap": float(getattr(res, "mip_gap", 0.0) or 0.0)}
    return MilpResult(layer_of=layer_of, status=status, info=info)
