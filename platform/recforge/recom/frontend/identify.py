"""Column identification on an exported ATen graph (RECom Alg. 1, paper §3.1.2).

* A table is a parameter / buffer / constant placeholder whose every use is the weight of an embedding
  lookup (``aten.embedding``, ``aten.embedding_bag*``, ``aten._embedding_bag*``, row ``index_select``).
* Every node is tagged with the tables upstream of it, capped: none, one table, or MANY.
* From each table, a breadth-first walk forward keeps nodes whose only upstream table is that one. Nodes
  of the walk used by a node outside it are the column's boundary; that user (normally the concat) is the
  convergence point. The column is the walk plus all ancestors of the boundary (inputs, preprocessing,
  shape computations; ancestors shared by several columns belong to each of them).
* The concat and the dense net belong to no column.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind
from torch.fx import Node

aten = torch.ops.aten

# lookup op -> (index of the weight argument, index of the ids argument)
LOOKUP_OPS: dict[object, tuple[int, int]] = {
    aten.embedding.default: (0, 1),
    aten.embedding_bag.default: (0, 1),
    aten.embedding_bag.padding_idx: (0, 1),
    aten._embedding_bag.default: (0, 1),
    aten._embedding_bag_forward_only.default: (0, 1),
    aten.index_select.default: (0, 2),  # index_select(weight, 0, ids): only with dim 0
}
_WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
MANY = "<many>"


@dataclass
class Column:
    table: str  # placeholder name of the table
    target: str  # its state-dict / constant key
    lookups: list[Node]
    forward: list[Node]  # the walk from the table, in graph order
    nodes: set[Node]  # forward walk + ancestors of the boundary
    boundary: list[Node]
    convergence: list[Node]

    @property
    def output(self) -> Node | None:
        """The one boundary node feeding the convergence point, when there is exactly one."""
        return self.boundary[0] if len(self.boundary) == 1 else None


@dataclass
class ColumnSet:
    columns: list[Column]
    tables: dict[str, str]  # placeholder -> target
    tags: dict[Node, str | None] = field(repr=False, default_factory=dict)
    rejected_weights: dict[str, str] = field(default_factory=dict)  # placeholder -> why it is not a table

    def by_convergence(self) -> dict[Node, list[Column]]:
        groups: dict[Node, list[Column]] = {}
        for c in self.columns:
            if len(c.convergence) == 1:
                groups.setdefault(c.convergence[0], []).append(c)
        return groups

    def dense_nodes(self, graph: torch.fx.Graph) -> list[Node]:
        inside = set().union(*(c.nodes for c in self.columns)) if self.columns else set()
        return [n for n in graph.nodes if n.op == "call_function" and n not in inside]


def _is_lookup_use(user: Node, weight: Node) -> bool:
    pos = LOOKUP_OPS.get(user.target)
    if pos is None:
        return False
    w, _ = pos
    if user.target is aten.index_select.default and (len(user.args) < 2 or user.args[1] != 0):
        return False
    return len(user.args) > w and user.args[w] is weight and weight not in user.args[w + 1:]


def find_tables(ep: torch.export.ExportedProgram) -> tuple[dict[str, str], dict[str, str]]:
    """(tables: placeholder -> target, rejected: placeholder -> reason) over the weight-like placeholders."""
    kinds = {s.arg.name: (s.kind, s.target) for s in ep.graph_signature.input_specs}
    tables, rejected = {}, {}
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in kinds or kinds[node.name][0] not in _WEIGHT_KINDS:
            continue
        users = list(node.users)
        lookups = [u for u in users if _is_lookup_use(u, node)]
        if lookups and len(lookups) == len(users):
            tables[node.name] = kinds[node.name][1]
        elif lookups:
            others = sorted({str(u.target) for u in users if u not in lookups})
            rejected[node.name] = f"used as an embedding table and also by {others}"
    return tables, rejected


def _inputs(node: Node) -> list[Node]:
    return list(node.all_input_nodes)


def tag_upstream_tables(graph: torch.fx.Graph, tables: dict[str, str]) -> dict[Node, str | None]:
    tags: dict[Node, str | None] = {}
    for node in graph.nodes:  # graph order is topological
        if node.op == "placeholder":
            tags[node] = node.name if node.name in tables else None
            continue
        seen = {tags[a] for a in _inputs(node)} - {None}
        tags[node] = MANY if MANY in seen or len(seen) > 1 else (seen.pop() if seen else None)
    return tags


def ancestors(nodes: set[Node]) -> set[Node]:
    out: set[Node] = set()
    todo = list(nodes)
    while todo:
        n = todo.pop()
        for a in _inputs(n):
            if a not in out and a not in nodes:
                out.add(a)
                todo.append(a)
    return out


def identify_columns(ep: torch.export.ExportedProgram) -> ColumnSet:
    graph = ep.graph
    tables, rejected = find_tables(ep)
    tags = tag_upstream_tables(graph, tables)
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    columns = []
    for name, target in tables.items():
        table = placeholders[name]
        walk: set[Node] = set()
        queue = deque(table.users)
        while queue:
            n = queue.popleft()
            if n in walk or tags.get(n) != name:
                continue
            walk.add(n)
            queue.extend(n.users)
        boundary: list[Node] = []
        convergence: list[Node] = []
        for n in sorted(walk, key=order.__getitem__):
            outside = [u for u in n.users if u not in walk]
            if outside:
                boundary.append(n)
                convergence.extend(u for u in outside if u not in convergence)
        nodes = walk | ancestors(set(boundary) | walk) | {table}
        columns.append(Column(
            table=name, target=target,
            lookups=[u for u in table.users],
            forward=sorted(walk, key=order.__getitem__),
            nodes=nodes, boundary=boundary, convergence=convergence,
        ))
    columns.sort(key=lambda c: order[c.output] if c.output is not None else order[c.lookups[0]])
    return ColumnSet(columns, tables, tags, rejected)
