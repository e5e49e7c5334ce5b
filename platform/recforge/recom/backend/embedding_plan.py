"""Lower optimized ColumnPrograms to the fused op's data: packed tables, boundaries, one metadata row each.

* Tables are packed into one float32 buffer, each starting on a 64-byte boundary; ``w_off`` says where.
* Columns are grouped by signature (translation x pooling x dim bucket): the metadata rows are sorted by
  group, so the kernel meets columns of one loop shape together; each still writes its own slice
  (``out_off``, its position in the original concat).
* Each column's workspace (its ids; jagged columns also their offsets[B + 1]) is a SymEngine upper bound
  over the input sizes, stored as coefficients of ``B`` and of the column's values length; the kernel
  evaluates them per call and makes one allocation. No size is read from tensor contents.
* A column whose ids are not proven to lie in [0, rows) is bounds-checked (IndexError, as eager).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import symengine as se
import torch

from recforge.recom.columns import program as prog
from recforge.recom.columns.intervals import INT64_MAX, INT64_MIN, IntervalSet
from recforge.recom.columns.passes import ids_range
from recforge.recom.columns.program import ColumnProgram
from recforge.recom.frontend.symshape import SymbolicShapes
from recforge_kernels import embedding_layout as L

_ALIGN = 16  # floats: 64 bytes
_SUPPORTED_DTYPES = {"int64", "int32", "int16", "int8", "uint8", "bool", "float32", "float64"}


class NotLowerable(ValueError):
    """A ColumnProgram the fused kernel cannot run; the message says why."""


def _span(keep: IntervalSet) -> tuple[int, int, int]:
    """(lo, hi, outside) for a kept set that is one interval or the complement of one."""
    if len(keep.spans) == 1:
        return keep.spans[0][0], keep.spans[0][1], 0
    if keep.is_empty:
        return INT64_MIN, INT64_MAX, 1
    comp = keep.complement()
    if len(comp.spans) == 1:
        return comp.spans[0][0], comp.spans[0][1], 1
    raise NotLowerable(f"kept set {keep} is neither an interval nor the complement of one")


def signature(p: ColumnProgram) -> str:
    steps = "+".join(type(s).__name__.lower() for s in p.steps) or "identity"
    pooling = "gather" if p.lookup == "gather" else f"{p.mode}"
    bucket = next(b for b in (4, 8, 16, 32, 64, 1 << 30) if p.dim <= b)
    return f"{steps}|{pooling}|{'jagged' if p.jagged else 'rows'}|dim<={bucket if bucket < 1 << 30 else 'any'}"


@dataclass
class EmbeddingPlan:
    """Everything the fused layer needs, plus what the compile report shows."""

    programs: list[ColumnProgram]  # metadata order (grouped by signature)
    concat_order: list[str]  # table placeholders in output order
    input_names: list[str]  # op inputs (placeholders), in order
    batch_input: str  # placeholder whose dim 0 is the batch
    weights: torch.Tensor
    fbuf: torch.Tensor
    ibuf: torch.Tensor
    meta: torch.Tensor
    total_dim: int
    groups: dict[str, int]
    workspace: str  # total elements, a SymEngine expression over the input sizes
    column_workspace: list[str]
    checked_columns: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "fused_columns": len(self.programs), "total_dim": self.total_dim, "op_inputs": len(self.input_names),
            "packed_table_bytes": self.weights.numel() * 4, "signature_groups": dict(self.groups),
            "workspace_elements": self.workspace, "bounds_checked_columns": list(self.checked_columns),
        }


def _steps_row(p: ColumnProgram, index_of: dict[str, int], fb: list[float], ib: list[int]) -> list[int]:
    out: list[int] = []
    for i, s in enumerate(p.steps):
        if isinstance(s, prog.Bucketize):
            is_float = any(isinstance(b, float) for b in s.boundaries) or p.value.dtype.startswith("float")
            off = len(fb) if is_float else len(ib)
            if is_float:
                fb.extend(float(b) for b in s.boundaries)
            else:
                ib.extend(int(b) for b in s.boundaries)
            if is_float and i != 0 and not p.value.dtype.startswith("float"):
                raise NotLowerable("float boundaries after an integer step")
            row = [L.OP_BUCKETIZE, off, len(s.boundaries), int(s.right), int(is_float), 0]
        elif isinstance(s, prog.Select):
            if s.flag.input not in index_of:
                raise NotLowerable(f"flag input {s.flag.input} is not an op input")
            lo, hi, outside = _span(s.keep)
            if outside:
                raise NotLowerable(f"select flag set {s.keep} is not one interval")
            row = [L.OP_SELECT, index_of[s.flag.input], -1 if s.flag.col is None else s.flag.col, lo, hi, s.value]
        elif isinstance(s, prog.Mod):
            row = [L.OP_MOD, s.n, 0, 0, 0, 0]
        elif isinstance(s, prog.SigridHash):
            row = [L.OP_SIGRID, s.salt, s.m, 0, 0, 0]
        elif isinstance(s, prog.Clamp):
            row = [L.OP_CLAMP, INT64_MIN if s.lo is None else s.lo, INT64_MAX if s.hi is None else s.hi, 0, 0, 0]
        elif isinstance(s, prog.AddConst):
            row = [L.OP_ADD, s.c, 0, 0, 0, 0]
        elif isinstance(s, prog.Replace):
            row = [L.OP_REPLACE, *_span(s.keep), s.value, 0]
        elif isinstance(s, prog.Remove):
            row = [L.OP_REMOVE, *_span(s.keep), 0, 0]
        else:
            raise NotLowerable(f"step {s!r} has no kernel form")
        out.extend(row)
    return out


def _workspace_bound(p: ColumnProgram, ss: SymbolicShapes, placeholders: dict) -> tuple[se.Expr, tuple[int, int, int]]:
    """Upper bound of the column's workspace (ids, + offsets[B + 1] when jagged) and its (b, n, c) coefficients."""
    n_vals = ss.shape_of(placeholders[p.value.input])[0]
    expr = n_vals
    if p.jagged:
        expr = expr + ss.shape_of(placeholders[p.lengths])[0] + 1
    expr = se.expand(ss.canon(expr))
    batch = ss.batch
    coeffs = expr.as_coefficients_dict()
    b = int(coeffs.get(batch, 0))
    const = int(coeffs.get(se.Integer(1), 0))
    others = {s for s in expr.free_symbols if s != batch}
    batch_term = b * batch if batch is not None else 0  # b is 0 without a batch
    if len(others) > 1 or (others and se.expand(expr - batch_term - const).free_symbols != others):
        raise NotLowerable(f"workspace bound {expr} is not linear in B and the values length")
    n = int(coeffs.get(next(iter(others)), 0)) if others else 0
    if others and next(iter(others)) != se.expand(ss.canon(n_vals)):
        raise NotLowerable(f"workspace bound {expr} depends on a size other than the column's values")
    return expr, (b, n, const)


def check_lowerable(p: ColumnProgram, ss: SymbolicShapes, placeholders: dict) -> str | None:
    """Why the kernel cannot run ``p`` (None when it can)."""
    try:
        if p.value.dtype not in _SUPPORTED_DTYPES:
            raise NotLowerable(f"values of dtype {p.value.dtype}")
        if p.value.dtype.startswith("float") and not (p.steps and isinstance(p.steps[0], prog.Bucketize)):
            raise NotLowerable("float values must be bucketized first")
        if len(p.steps) > L.MAX_STEPS:
            raise NotLowerable(f"{len(p.steps)} steps (the kernel runs up to {L.MAX_STEPS})")
        if p.unique or (p.fill_empty is not None and p.zero_empty):
            raise NotLowerable("unique / fill + zero of empty rows left after the passes")
        names = {p.value.input, *( [p.lengths] if p.lengths else []),
                 *(s.flag.input for s in p.steps if isinstance(s, prog.Select))}
        _steps_row(p, {n: 0 for n in names}, [], [])
        _workspace_bound(p, ss, placeholders)
    except NotLowerable as e:
        return str(e)
    return None


def build_plan(programs: list[ColumnProgram], tables: dict[str, torch.Tensor], ss: SymbolicShapes,
               placeholders: dict, batch_input: str) -> EmbeddingPlan:
    """``programs`` in concat order; ``tables``: placeholder -> weight tensor. Raises NotLowerable."""
    out_off: dict[str, int] = {}
    off = 0
    for p in programs:
        out_off[p.table] = off
        off += p.dim
    total_dim = off
    for p in programs:
        if p.value.dtype not in _SUPPORTED_DTYPES:
            raise NotLowerable(f"{p.name}: values of dtype {p.value.dtype}")
        if p.value.dtype.startswith("float") and not (p.steps and isinstance(p.steps[0], prog.Bucketize)):
            raise NotLowerable(f"{p.name}: float values must be bucketized first")
        if len(p.steps) > L.MAX_STEPS:
            raise NotLowerable(f"{p.name}: {len(p.steps)} steps (the kernel runs up to {L.MAX_STEPS})")
        if p.fill_empty is not None and p.zero_empty:
            raise NotLowerable(f"{p.name}: fill + zero of empty rows left after the passes")
        if p.unique:
            raise NotLowerable(f"{p.name}: unique left after the passes")
    ordered = sorted(programs, key=lambda p: (signature(p), out_off[p.table]))
    input_names: list[str] = []

    def index(name: str) -> int:
        if name not in input_names:
            input_names.append(name)
        return input_names.index(name)

    for p in ordered:  # op inputs: values, lengths, flags, in metadata order
        index(p.value.input)
        if p.lengths:
            index(p.lengths)
        for s in p.steps:
            if isinstance(s, prog.Select):
                index(s.flag.input)
    index_of = {n: i for i, n in enumerate(input_names)}
    fb: list[float] = []
    ib: list[int] = []
    rows, w_offs, ws_exprs, checked = [], [], [], []
    w_total = 0
    for p in ordered:
        w_offs.append(w_total)
        w_total += -(-p.rows * p.dim // _ALIGN) * _ALIGN
    for p, w_off in zip(ordered, w_offs, strict=True):
        expr, (wb, wn, wc) = _workspace_bound(p, ss, placeholders)
        ws_exprs.append(expr)
        r = ids_range(p)
        check = int(r is None or not IntervalSet.of((0, p.rows - 1)).contains(r))
        if check:
            checked.append(p.name)
        lookup = L.LOOKUP_GATHER if p.lookup == "gather" else (L.LOOKUP_MEAN if p.mode == "mean" else L.LOOKUP_SUM)
        head = {
            "in_value": index_of[p.value.input], "in_col": -1 if p.value.col is None else p.value.col,
            "in_lengths": index_of[p.lengths] if p.lengths else -1, "lookup": lookup,
            "empty_id": -1 if p.fill_empty is None else p.fill_empty, "rows": p.rows, "dim": p.dim,
            "w_off": w_off, "out_off": out_off[p.table], "check": check, "nsteps": len(p.steps),
            "ws_b": wb, "ws_n": wn, "ws_c": wc,
        }
        row = [head[k] for k in L.META_FIELDS] + _steps_row(p, index_of, fb, ib)
        rows.append(row + [0] * (L.META_WIDTH - len(row)))
    weights = torch.zeros(max(w_total, 1), dtype=torch.float32)
    for p, w_off in zip(ordered, w_offs, strict=True):
        t = tables[p.table].detach()
        if tuple(t.shape) != (p.rows, p.dim):
            raise NotLowerable(f"{p.name}: table shape {tuple(t.shape)} != ({p.rows}, {p.dim})")
        weights[w_off: w_off + p.rows * p.dim].copy_(t.reshape(-1))
    groups: dict[str, int] = {}
    for p in ordered:
        groups[signature(p)] = groups.get(signature(p), 0) + 1
    total_ws = se.expand(sum(ws_exprs, se.Integer(0)))
    return EmbeddingPlan(
        programs=ordered, concat_order=[p.table for p in programs], input_names=input_names,
        batch_input=batch_input, weights=weights,
        fbuf=torch.tensor(fb or [0.0], dtype=torch.float64), ibuf=torch.tensor(ib or [0], dtype=torch.int64),
        meta=torch.tensor(rows, dtype=torch.int64).reshape(len(rows), L.META_WIDTH), total_dim=total_dim,
        groups=groups, workspace=str(total_ws), column_workspace=[str(e) for e in ws_exprs], checked_columns=checked,
    )
