"""The column compiler: captured program -> fused embedding plan + what it proved and changed.

identify columns (Alg. 1) -> symbolic shapes (SymEngine) -> analysis into ColumnPrograms -> column
passes -> lowering to the fused op. A column the analysis or the kernel cannot take stays in the
residual graph and runs as captured; the report says which and why.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from recforge.recom.backend.dense import convergence_ok, convergence_parts
from recforge.recom.backend.embedding_plan import EmbeddingPlan, build_plan, check_lowerable
from recforge.recom.columns.analyze import analyze_columns
from recforge.recom.columns.passes import PassLog, optimize
from recforge.recom.columns.program import ColumnProgram
from recforge.recom.frontend.capture import Capture
from recforge.recom.frontend.identify import ColumnSet, identify_columns
from recforge.recom.frontend.symshape import SymbolicShapes

aten = torch.ops.aten
_SHAPE_OPS = {aten.sym_size.int, aten.arange.default, aten.arange.start, aten.arange.start_step,
              aten._assert_scalar.default, aten._assert_tensor_metadata.default}
_DATA_DEPENDENT = {aten.index.Tensor, aten._unique2.default, aten.nonzero.default, aten.repeat_interleave.Tensor,
                   aten.repeat_interleave.self_Tensor, aten.bincount.default}


@dataclass
class ColumnCompilation:
    capture: Capture
    columns: ColumnSet
    shapes: SymbolicShapes
    programs: dict[str, ColumnProgram]  # fused columns, optimized, by table placeholder
    plan: EmbeddingPlan | None
    fused_out: dict[Node, tuple[int, int]]  # column output node -> (offset, dim) in the fused output
    report: dict[str, Any] = field(default_factory=dict)


def _is_shape_node(n: Node, ss: SymbolicShapes) -> bool:
    if n.op != "call_function":
        return False
    if n.target in _SHAPE_OPS or (n in ss.value and n.target is not aten.embedding.default):
        return True
    return not isinstance(n.target, torch._ops.OpOverload)  # python operators on SymInts


def compile_columns(cap: Capture) -> ColumnCompilation:
    ep = cap.program
    cs = identify_columns(ep)
    ss = SymbolicShapes(ep, batch_symbol=cap.batch_symbol, batch_size=cap.batch_size)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    analyzed = analyze_columns(ep, ss, cs) if cs.columns else {}
    log = PassLog()
    status: list[dict[str, Any]] = []
    fused: list[tuple[Node, int, ColumnProgram]] = []  # (convergence, position, program)
    for col in cs.columns:
        entry: dict[str, Any] = {"table": col.target, "nodes": len(col.nodes)}
        raw = analyzed[col.table]
        out = col.output
        reason = None
        if isinstance(raw, str):
            reason = raw
        elif len(col.convergence) != 1 or not convergence_ok(col.convergence[0]):
            reason = f"converges into {[str(c.target) for c in col.convergence]}, not one concat / stack over dim 1"
        else:
            assert out is not None  # the analysis gives a program only for a column with one output node
            if convergence_parts(col.convergence[0]).count(out) != 1:
                reason = "its output appears more than once in the concat"
        if reason is None and not isinstance(raw, str) and out is not None:
            entry["graph"] = raw.describe()
            opt = optimize(raw, log)
            entry["fused"] = opt.describe()
            reason = check_lowerable(opt, ss, placeholders)
            if reason is None:
                conv = col.convergence[0]
                fused.append((conv, convergence_parts(conv).index(out), opt))
        entry["status"] = "residual" if reason else "fused"
        if reason:
            entry["reason"] = reason
        status.append(entry)
    order = {n: i for i, n in enumerate(ep.graph.nodes)}
    fused.sort(key=lambda t: (order[t[0]], t[1]))
    programs = [p for _, _, p in fused]
    plan = None
    fused_out: dict[Node, tuple[int, int]] = {}
    if programs:
        tables = {p.table: _table(ep, p.table) for p in programs}
        batch_input = next(n for n in cap.input_names
                           if ss.prove_equal(ss.shape_of(placeholders[n])[0], ss.batch)) if ss.batch is not None \
            else cap.input_names[0]
        plan = build_plan(programs, tables, ss, placeholders, batch_input)
        by_table = {c.table: c for c in cs.columns}
        off = 0
        for p in programs:
            out = by_table[p.table].output
            assert out is not None  # the analysis fuses only a column with one output node
            fused_out[out] = (off, p.dim)
            off += p.dim
    report = _report(cs, ss, status, log, plan, fused_out, order)
    return ColumnCompilation(cap, cs, ss, {p.table: p for p in programs}, plan, fused_out, report)


def _table(ep: torch.export.ExportedProgram, placeholder: str) -> torch.Tensor:
    spec = next(s for s in ep.graph_signature.input_specs if s.arg.name == placeholder)
    state = dict(ep.state_dict)
    state.update(getattr(ep, "constants", {}) or {})
    return state[spec.target]


def _report(cs: ColumnSet, ss: SymbolicShapes, status, log: PassLog, plan, fused_out, order) -> dict[str, Any]:
    fused_tables = {e["table"] for e in status if e["status"] == "fused"}
    fused_cols = [c for c in cs.columns if c.target in fused_tables]
    inside = set().union(*(c.nodes for c in fused_cols)) if fused_cols else set()
    ops = [n for n in inside if n.op == "call_function"]
    shape_nodes = [n for n in ops if _is_shape_node(n, ss)]
    data_dep = [n for n in ops if n.target in _DATA_DEPENDENT]
    ids_bounds = {}
    for c in fused_cols:
        lk = c.lookups[0]
        ids = lk.args[1]
        try:
            ids_bounds[c.target] = str(ss.upper_bound(ss.numel(ids)))
        except (ValueError, KeyError):
            ids_bounds[c.target] = "unbounded"
    out_rows = {str(ss.canon(ss.shape_of(n)[0])) for n in fused_out}
    return {
        "columns": len(cs.columns),
        "fused": len(fused_cols),
        "residual": {e["table"]: e["reason"] for e in status if e["status"] == "residual"},
        "rejected_weights": dict(cs.rejected_weights),
        "column_ops_replaced": len(ops),
        "shape_computations_removed": len(shape_nodes),
        "data_dependent_ops_removed": len(data_dep),
        "passes": log.counts(),
        "pass_log": {"dropped": log.dropped, "merged": log.merged, "empty_rows": log.empty_rows,
                     "gathers": log.gathers},
        "shapes": {
            "batch_symbol": str(ss.batch),
            "columns_share_batch": out_rows == {str(ss.batch)} if fused_out else None,
            "unifications": [f"{a} == {b} (at {n.name})" for a, b, n in ss.unified],
            "from_export": len(ss.from_export),
            "graph_ids_upper_bounds": ids_bounds,
        },
        "plan": plan.summary() if plan is not None else None,
        "per_column": status,
    }
