"""Read each column's ATen subgraph into a ColumnProgram, by abstract interpretation.

Every node gets an abstract value in terms of the raw inputs through one transfer rule per supported ATen op
(``_RULES``); an op without one makes the column unsupported with the reason (it then stays in the residual
graph, run as captured). Everything is recorded, redundant filters included; ``passes.py`` removes what is
implied. What is recognized: docs/recom.md#column-analysis.
"""
from __future__ import annotations

import operator
from typing import Any

import symengine as se
import torch
from torch.export.graph_signature import InputKind
from torch.fx import Node

from recforge.recom.columns.absval import (
    INT_DTYPES,
    Cond,
    Const,
    Dead,
    Elems,
    Filled,
    Filt,
    Grid,
    Like,
    Lookup,
    Stream,
    Sym,
    Table,
    Unsupported,
    dtype_name,
)
from recforge.recom.columns.intervals import IntervalSet
from recforge.recom.columns.program import Bucketize, ColumnProgram, Remove, Src
from recforge.recom.columns.rules import _ELEMENTWISE, _RULES
from recforge.recom.frontend.identify import Column, ColumnSet
from recforge.recom.frontend.symshape import SymbolicShapes

__all__ = ["ColumnAnalyzer", "Unsupported", "analyze_columns"]


class ColumnAnalyzer:
    """Abstract interpretation of the column nodes of one exported program (memoized across columns)."""

    def __init__(self, ep: torch.export.ExportedProgram, shapes: SymbolicShapes, columns: ColumnSet):
        self.ep, self.ss, self.columns = ep, shapes, columns
        self.values: dict[Node, Any] = {}
        self.errors: dict[Node, str] = {}
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
        self.user_inputs = [n for n, s in specs.items() if s.kind == InputKind.USER_INPUT]
        self.consts: dict[str, torch.Tensor] = {}
        state = dict(ep.state_dict)
        state.update(getattr(ep, "constants", {}) or {})
        for name, spec in specs.items():
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR) and spec.target in state:
                self.consts[name] = state[spec.target]
        self.batch = shapes.batch
        nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
        self.placeholder = nodes
        self.batch_major = {n for n in self.user_inputs if self._dim0(nodes[n]) is not None
                            and shapes.prove_equal(self._dim0(nodes[n]), self.batch)}
        self._by_symbol: dict[se.Symbol, str] = {}  # dim-0 symbol -> first user input with it
        for n in self.user_inputs:
            d = self._dim0(nodes[n])
            if d is not None and isinstance(d, se.Symbol):
                self._by_symbol.setdefault(d, n)

    def _dim0(self, node: Node):
        s = self.ss.shape.get(node)
        return self.ss.canon(s[0]) if isinstance(s, tuple) and s else None

    # driver ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, ColumnProgram | str]:
        """{table placeholder: ColumnProgram, or the reason the column is not supported}."""
        order = {n: i for i, n in enumerate(self.ep.graph.nodes)}
        needed = set().union(*(c.nodes for c in self.columns.columns)) if self.columns.columns else set()
        for node in sorted(needed, key=order.__getitem__):
            self._eval(node)
        return {c.table: self._program(c) for c in self.columns.columns}

    def _eval(self, node: Node) -> None:
        if node in self.values or node in self.errors:
            return
        try:
            self.values[node] = self._interpret(node)
        except Unsupported as e:
            self.errors[node] = str(e)

    def val(self, arg: Any) -> Any:
        if isinstance(arg, Node):
            if arg in self.errors:
                raise Unsupported(self.errors[arg])
            if arg not in self.values:
                self._eval(arg)
                return self.val(arg)
            v = self.values[arg]
            if isinstance(v, Dead):
                raise Unsupported(f"{arg.name}: {v.why}")
            return v
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.val(a) for a in arg)
        return arg

    def _program(self, column: Column) -> ColumnProgram | str:
        out = column.output
        if out is None:
            return f"column has {len(column.boundary)} boundary nodes; expected one output"
        if len(column.lookups) != 1:
            return f"table is looked up {len(column.lookups)} times; one lookup per column is supported"
        try:
            value = self.val(out)
        except Unsupported as e:
            return str(e)
        if not isinstance(value, Lookup):
            return f"column output {out.name} is not a lookup result (got {type(value).__name__})"
        shape = self.ss.shape_of(out)
        table = self.consts.get(column.table)
        if table is None or table.dim() != 2:
            return f"table {column.table} is not a 2-D tensor"
        if table.dtype != torch.float32:
            return f"table {column.table} is {table.dtype}; the fused kernel reads float32 tables"
        if len(shape) != 2 or not self.ss.prove_equal(shape[0], self.batch) or shape[1] != table.shape[1]:
            return f"column output {out.name} has shape {shape}, not [B, {table.shape[1]}]"
        try:
            return self._to_program(column, value, int(table.shape[0]), int(table.shape[1]))
        except Unsupported as e:
            return str(e)

    def _to_program(self, column: Column, lk: Lookup, rows: int, dim: int) -> ColumnProgram:
        s = lk.stream
        dom, fill = s.dom, None
        if isinstance(dom, Filled):
            fill, dom = s.fill, dom.parent
        removes: list[tuple[int, Remove]] = []
        while isinstance(dom, Filt):
            c = dom.cond
            if c.src != s.src or c.steps != s.steps[: len(c.steps)]:
                raise Unsupported("a filter tests a value other than the looked-up ids' own chain")
            removes.append((len(c.steps), Remove(c.keep)))
            dom = dom.parent
        if not isinstance(dom, Elems) or dom.input != s.src.input:
            raise Unsupported(f"ids do not run over their input's elements ({dom})")
        steps = list(s.steps)
        for pos, rm in sorted(removes, key=lambda t: t[0], reverse=True):
            steps.insert(pos, rm)
        steps.extend(lk.extra_steps)
        if s.is_float and not any(isinstance(x, Bucketize) for x in steps):
            raise Unsupported("float values reach the lookup without a bucketize")
        jagged = lk.lengths is not None
        if not jagged and s.src.input not in self.batch_major:
            raise Unsupported(f"input {s.src.input} is neither batch-major nor paired with lengths")
        return ColumnProgram(
            name=column.target, table=column.table, rows=rows, dim=dim, value=s.src, steps=tuple(steps),
            lookup=lk.kind, mode=lk.mode, lengths=lk.lengths, one_id_proof=lk.one_id_proof,
            fill_empty=fill, zero_empty=lk.zero_empty, unique=lk.unique,
        )

    # interpretation ------------------------------------------------------------------------------------
    def _interpret(self, node: Node) -> Any:
        if node.op == "placeholder":
            return self._placeholder(node)
        if node.op != "call_function":
            raise Unsupported(f"{node.name}: {node.op} nodes are not modeled")
        if node in self.ss.value and node.target is not operator.getitem:
            return Sym(self.ss.canon(self.ss.value[node]))
        rule = _RULES.get(node.target)
        if rule is None:
            raise Unsupported(f"{node.name}: op {node.target} is not modeled by the column analysis")
        out = rule(self, node)
        if isinstance(out, Grid) and rule in _ELEMENTWISE:
            first = next(a for a in node.args if isinstance(a, Node))
            if not all(self.ss.prove_equal(p, q) for p, q in zip(self.shape(node), self.shape(first), strict=False)) \
                    or len(self.shape(node)) != len(self.shape(first)):
                raise Unsupported(f"{node.name}: broadcasting changes the feature grid's shape")
        if out is None:
            raise Unsupported(f"{node.name}: {node.target} with these arguments is not modeled "
                              f"({', '.join(type(self.values.get(a)).__name__ for a in node.all_input_nodes)})")
        return out

    def _placeholder(self, node: Node) -> Any:
        if node.name in self.columns.tables:
            return Table(node.name)
        if node.name in self.consts:
            return Const(self.consts[node.name])
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return Sym(self.ss.value.get(node))
        dtype = val.dtype
        if val.dim() == 1:
            return self._raw(node.name, None, dtype)
        if val.dim() == 2 and isinstance(val.shape[1], int):
            return Grid(tuple(self._raw(node.name, j, dtype) for j in range(val.shape[1])))
        raise Unsupported(f"input {node.name} has {val.dim()} dims; 1-D and [B, F] inputs are modeled")

    def _raw(self, name: str, col: int | None, dtype: torch.dtype):
        src = Src(name, col, dtype_name(dtype))
        if dtype == torch.bool:
            return Cond(Elems(name), src, (), IntervalSet.point(1))
        if dtype not in INT_DTYPES and not dtype.is_floating_point:
            raise Unsupported(f"input {name} has dtype {dtype}")
        return Stream(Elems(name), src, (), dtype.is_floating_point)

    # helpers ------------------------------------------------------------------------------------------
    def shape(self, node: Node) -> tuple:
        return self.ss.shape_of(node)

    def is_batch(self, e: Any) -> bool:
        return e is not None and self.ss.prove_equal(e, self.batch)

    def scalar(self, a: Any) -> int | float | None:
        """A Python number, a 0-dim constant, or a Like/Const filled with one value."""
        if isinstance(a, bool):
            return int(a)
        if isinstance(a, (int, float)):
            return a
        if isinstance(a, Const) and a.tensor.numel() == 1:
            return a.tensor.item()
        if isinstance(a, Like):
            return a.value
        return None

    def input_of_symbol(self, e: Any) -> str | None:
        e = self.ss.canon(e)
        return self._by_symbol.get(e) if isinstance(e, se.Symbol) else None




def analyze_columns(ep: torch.export.ExportedProgram, shapes: SymbolicShapes,
                    columns: ColumnSet) -> dict[str, ColumnProgram | str]:
    return ColumnAnalyzer(ep, shapes, columns).run()
