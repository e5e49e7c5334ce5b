"""The op DAG of a plan (RAP's parse_file + batch-class pass).

One node per op application. Chains of the same class that start alike (same source column, same ops with the
same parameters) share their common prefix, so a node may feed several consumers (a tree per source column and
class). Each node has a batch class: "dense" (feeds dense features: data-parallel, local batch) or "sparse"
(feeds sparse features: runs where the embedding table lives, over the global batch). A prefix that feeds both
classes is built once per class: RAP duplicates such a node (its fill_null(int_0) feeding logit and bucketize).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from recforge.preprocess.planning.plan import Plan

BatchClass = Literal["dense", "sparse"]


@dataclass(frozen=True)
class Node:
    id: int
    op: str
    params: dict[str, Any]
    cls: BatchClass
    source: str  # the dataset column at the root of this node's chain
    parent: int | None  # None: reads the raw source column
    depth: int  # ops above it on its chain (0 for a root)
    duplicated: bool  # the same prefix also exists in the other class

    @property
    def type(self) -> str:
        """RAP's fusion type: op name and batch class (e.g. `sigrid_hash_sparse`)."""
        return f"{self.op}_{self.cls}"

    @property
    def input_id(self) -> int:
        """The node whose values this one reads; a root (fill_null, reading the raw source column) has none."""
        if self.parent is None:
            raise ValueError(f"node {self.id} ({self.type}) is a root: it reads the raw source column")
        return self.parent


@dataclass
class OpGraph:
    nodes: list[Node]
    outputs: dict[str, int]  # feature name -> the node giving its final values
    children: dict[int, list[int]] = field(default_factory=dict)
    _through: tuple[tuple[int, int], dict[int, list[str]]] | None = field(default=None, init=False, repr=False,
                                                                          compare=False)

    def edges(self) -> list[tuple[int, int]]:
        return [(n.parent, n.id) for n in self.nodes if n.parent is not None]

    def roots(self) -> list[int]:
        return [n.id for n in self.nodes if n.parent is None]

    def height(self, node: int) -> int:
        """Longest chain of ops below `node` (0 for a leaf)."""
        kids = self.children.get(node, [])
        return 1 + max(self.height(k) for k in kids) if kids else 0

    def features_of(self, node: int) -> list[str]:
        """Features whose chains pass through `node`, in `outputs` order."""
        size = (len(self.nodes), len(self.outputs))
        if self._through is None or self._through[0] != size:  # built once per graph (a graph is not edited)
            parents = {n.id: n.parent for n in self.nodes}
            through: dict[int, list[str]] = {}
            for f, n in self.outputs.items():  # every node on the feature's chain, walking up to its root
                cur: int | None = n
                while cur is not None:
                    through.setdefault(cur, []).append(f)
                    cur = parents.get(cur)
            self._through = (size, through)
        return list(self._through[1].get(node, []))

    def summary(self) -> dict[str, Any]:
        return {
            "nodes": len(self.nodes),
            "edges": len(self.edges()),
            "duplicated": sum(n.duplicated for n in self.nodes),
            "by_class": {c: sum(n.cls == c for n in self.nodes) for c in ("dense", "sparse")},
        }


def _key(op: str, params: dict[str, Any]) -> str:
    return op + json.dumps(params, sort_keys=True)


def build_graph(plan: Plan) -> OpGraph:
    """Nodes in plan order (a node's parent always comes first); common prefixes shared within a class."""
    nodes: list[Node] = []
    index: dict[tuple, int] = {}  # (class, source, op keys of the prefix) -> node id
    prefixes: dict[str, set[tuple]] = {"dense": set(), "sparse": set()}
    for f in plan.features:
        prefix: tuple = (f.source,)
        for spec in f.ops:
            prefix = prefix + (_key(spec.op, spec.params),)
            prefixes[f.kind].add(prefix)
    outputs: dict[str, int] = {}
    children: dict[int, list[int]] = {}
    for f in plan.features:
        parent, prefix = None, (f.source,)
        other = "sparse" if f.kind == "dense" else "dense"
        for depth, spec in enumerate(f.ops):
            prefix = prefix + (_key(spec.op, spec.params),)
            key = (f.kind, *prefix)
            if key not in index:
                node = Node(id=len(nodes), op=spec.op, params=dict(spec.params), cls=f.kind, source=f.source,
                            parent=parent, depth=depth, duplicated=prefix in prefixes[other])
                nodes.append(node)
                index[key] = node.id
                if parent is not None:
                    children.setdefault(parent, []).append(node.id)
            parent = index[key]
        assert parent is not None  # a feature has at least one op (FeaturePlan.ops: min_length=1)
        outputs[f.name] = parent
    return OpGraph(nodes=nodes, outputs=outputs, children=children)
