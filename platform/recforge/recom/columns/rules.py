"""Transfer rules of the column analysis: one function per ATen op family, from abstract argument values
to the abstract value of the result (None: these arguments are not modeled). ``a`` is the running
``ColumnAnalyzer`` (its ``val``, ``shape``, ``scalar``, ``is_batch`` ... helpers)."""
from __future__ import annotations

import operator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

import recforge_kernels  # noqa: F401  (torch.ops.recforge.* keys the rules)
from recforge.recom.columns.absval import (
    INT_DTYPES,
    Bag,
    Cond,
    Const,
    Counts,
    Cumsum,
    Dead,
    Elems,
    EmptyMask,
    EmptyRows,
    EmptyRowsDom,
    Filled,
    Filt,
    Grid,
    Like,
    Lookup,
    Offsets,
    Ones,
    RowIndex,
    Rows,
    Seg,
    Stream,
    Table,
    UniqueOf,
    UniqueRows,
    Zeros,
)
from recforge.recom.columns.intervals import IntervalSet
from recforge.recom.columns.program import AddConst, Bucketize, Clamp, Mod, Remove, Replace, Select, SigridHash, Src

if TYPE_CHECKING:
    from recforge.recom.columns.analyze import ColumnAnalyzer

aten = torch.ops.aten
recforge_ops = torch.ops.recforge

_CMP = {aten.ge.Scalar: "ge", aten.gt.Scalar: "gt", aten.le.Scalar: "le", aten.lt.Scalar: "lt",
        aten.eq.Scalar: "eq", aten.ne.Scalar: "ne"}
_AND = (aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default)
_OR = (aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default)
_NOT = (aten.bitwise_not.default, aten.logical_not.default)
_NOOP = (aten.alias.default, aten.detach.default, aten.clone.default, aten.contiguous.default,
         aten.lift_fresh_copy.default)
_BAG_OPS = (aten.embedding_bag.default, aten.embedding_bag.padding_idx, aten._embedding_bag.default,
            aten._embedding_bag_forward_only.default)


def _map(v: Any, fn) -> Any:
    """Apply fn to a stream, or to every column of a grid."""
    if isinstance(v, Grid):
        cols = tuple(fn(c, j) for j, c in enumerate(v.cols))
        return None if any(c is None for c in cols) else Grid(cols, v.faxis)
    return fn(v, None)


def _step(v: Any, step_for) -> Any:
    def fn(s, j):
        if not isinstance(s, Stream) or s.fill is not None:
            return None
        step = step_for(s, j)
        return None if step is None else replace(s, steps=s.steps + (step,))
    return _map(v, fn)


def _per_col(p: Any, j: int | None) -> Any:
    """Column j's value of a per-feature constant ([F], or [1, F, 1]-like); scalars pass through."""
    if isinstance(p, Const) and j is not None and p.tensor.numel() > 1:
        if sum(1 for d in p.tensor.shape if d != 1) != 1:
            return None
        return p.tensor.reshape(-1)[j].item()
    if isinstance(p, Const) and p.tensor.numel() == 1:
        return p.tensor.item()
    return p


def r_bucketize(a: ColumnAnalyzer, n: Node):
    x, b = a.val(n.args[0]), a.val(n.args[1])
    right = bool(n.kwargs.get("right", False))
    if n.kwargs.get("out_int32", False) or not isinstance(b, Const) or b.tensor.dim() != 1:
        return None
    bnd = b.tensor
    if bnd.numel() > 1 and not bool((bnd[1:] >= bnd[:-1]).all()):
        return None  # unsorted boundaries: torch's result is unspecified
    if bnd.is_floating_point() and bool(torch.isnan(bnd).any()):
        return None
    x_float = isinstance(x, Stream) and x.is_float
    if not x_float and bnd.is_floating_point():
        return None  # int values against float boundaries: promotion the kernel does not model
    step = Bucketize(tuple(float(v) for v in bnd.tolist()) if bnd.is_floating_point()
                     else tuple(int(v) for v in bnd.tolist()), right)
    out = _step(x, lambda s, j: step)
    return _map(out, lambda s, j: replace(s, is_float=False))


def r_remainder(a, n):
    x, m = a.val(n.args[0]), a.val(n.args[1])

    def step(s, j):
        d = a.scalar(_per_col(m, j))
        if s.is_float or not isinstance(d, int) or d <= 0:
            return None
        return Mod(d)
    return _step(x, step)


def r_sigrid(a, n):
    x, salt, m = (a.val(v) for v in n.args[:3])

    def step(s, j):
        mm = a.scalar(_per_col(m, j))
        if s.is_float or not isinstance(salt, int) or not isinstance(mm, int) or mm < 1:
            return None
        return SigridHash(salt, mm)
    return _step(x, step)


def r_clamp(a, n):
    x = a.val(n.args[0])
    if n.target is aten.clamp_min.default:
        lo, hi = a.val(n.args[1]), None
    elif n.target is aten.clamp_max.default:
        lo, hi = None, a.val(n.args[1])
    else:
        lo = a.val(n.args[1]) if len(n.args) > 1 else n.kwargs.get("min")
        hi = a.val(n.args[2]) if len(n.args) > 2 else n.kwargs.get("max")
    if isinstance(x, Counts) and lo == 1 and hi is None:
        return replace(x, clamped=True)
    if not all(v is None or isinstance(v, int) for v in (lo, hi)):
        return None
    return _step(x, lambda s, j: None if s.is_float else Clamp(lo, hi))


def r_add(a, n):
    x, c = a.val(n.args[0]), a.val(n.args[1])
    alpha = n.kwargs.get("alpha", 1)
    sign = -1 if n.target in (aten.sub.Tensor, aten.sub.Scalar) else 1

    def step(s, j):
        v = a.scalar(_per_col(c, j))
        if s.is_float or not isinstance(v, int) or not isinstance(alpha, int):
            return None
        return AddConst(sign * alpha * v)
    return _step(x, step)


def r_compare(a, n):
    x, c = a.val(n.args[0]), a.scalar(a.val(n.args[1]))
    if isinstance(x, Counts) and n.target is aten.eq.Scalar and c == 0 and not x.clamped:
        return EmptyMask(x.dom, x.lengths)
    if not isinstance(c, int):
        return None
    keep = IntervalSet.compare(_CMP[n.target], c)

    def fn(s, j):
        if not isinstance(s, Stream) or s.is_float or s.fill is not None:
            return None
        return Cond(s.dom, s.src, s.steps, keep)
    return _map(x, fn)


def _cond_combine(a, n, how):
    x, y = a.val(n.args[0]), a.val(n.args[1])

    def fn(cx, j):
        cy = y.cols[j] if isinstance(y, Grid) else y
        if not (isinstance(cx, Cond) and isinstance(cy, Cond)):
            return None
        if (cx.dom, cx.src, cx.steps) != (cy.dom, cy.src, cy.steps):
            return None
        return replace(cx, keep=how(cx.keep, cy.keep))
    if isinstance(x, Grid) != isinstance(y, Grid) or (isinstance(x, Grid) and x.faxis != y.faxis):
        return None
    return _map(x, fn)


def r_and(a, n):
    return _cond_combine(a, n, IntervalSet.intersect)


def r_or(a, n):
    return _cond_combine(a, n, IntervalSet.union)


def r_not(a, n):
    x = a.val(n.args[0])
    return _map(x, lambda c, j: replace(c, keep=c.keep.complement()) if isinstance(c, Cond) else None)


def _select_step(a: ColumnAnalyzer, cond: Cond, s: Stream, value: Any, keep_when_true: bool):
    """where(cond, s, value) (keep_when_true) or where(cond, value, s) as one step on s."""
    v = a.scalar(value)
    if not isinstance(v, int):
        return None
    if not isinstance(s, Stream) or s.is_float or s.fill is not None or not isinstance(cond, Cond):
        return None
    keep = cond.keep if keep_when_true else cond.keep.complement()
    if (cond.src, cond.steps) == (s.src, s.steps) and cond.dom == s.dom:
        return replace(s, steps=s.steps + (Replace(keep, int(v)),))
    rows_aligned = isinstance(cond.dom, Elems) and isinstance(s.dom, Elems) and \
        cond.dom.input in a.batch_major and s.dom.input in a.batch_major
    if cond.steps == () and (cond.dom == s.dom or rows_aligned):
        return replace(s, steps=s.steps + (Select(cond.src, keep, int(v)),))
    return None


def r_where(a, n):
    c, x, y = (a.val(v) for v in n.args[:3])
    if isinstance(c, EmptyMask):
        return _zero_empty(a, n, c, x, y)
    if isinstance(x, (Stream, Grid)) and not isinstance(y, (Stream, Grid)):
        stream, other, keep_true = x, y, True
    elif isinstance(y, (Stream, Grid)) and not isinstance(x, (Stream, Grid)):
        stream, other, keep_true = y, x, False
    else:
        return None
    if isinstance(stream, Grid):
        if not isinstance(c, Grid) or len(c.cols) != len(stream.cols) or c.faxis != stream.faxis:
            return None
        cols = tuple(_select_step(a, cc, s, _per_col(other, j), keep_true)
                     for j, (cc, s) in enumerate(zip(c.cols, stream.cols, strict=True)))
        return None if any(v is None for v in cols) else Grid(cols, stream.faxis)
    return _select_step(a, c, stream, other, keep_true)


def r_masked_fill(a, n):
    x, mask, value = (a.val(v) for v in n.args[:3])
    if isinstance(x, Grid):
        if not isinstance(mask, Grid) or len(mask.cols) != len(x.cols) or mask.faxis != x.faxis:
            return None
        cols = tuple(_select_step(a, m, s, _per_col(value, j), False)
                     for j, (m, s) in enumerate(zip(mask.cols, x.cols, strict=True)))
        return None if any(v is None for v in cols) else Grid(cols, x.faxis)
    return _select_step(a, mask, x, value, False)


def r_like(a, n):
    x = a.val(n.args[0])
    if n.target is aten.zeros_like.default:
        v = 0
    elif n.target is aten.ones_like.default:
        v = 1
    else:
        v = a.scalar(a.val(n.args[1]))
    if isinstance(x, EmptyRows) and v == 0:
        return Stream(EmptyRowsDom(x.dom, x.lengths), Src("<fill>"), (), False, fill=0)
    if isinstance(x, Seg) and v == 1:
        return Ones(a.ss.numel(n.args[0]))
    return Like(v, x)


def r_cast(a, n):
    x = a.val(n.args[0])
    dtype = n.args[1] if n.target is aten.to.dtype else n.kwargs.get("dtype")
    if isinstance(x, Counts):
        return x
    if dtype is None:
        return x
    src_dtype = n.args[0].meta["val"].dtype
    if src_dtype in INT_DTYPES and dtype == torch.int64:
        return x  # widening keeps every value
    if src_dtype == dtype:
        return x
    if src_dtype.is_floating_point and dtype.is_floating_point \
            and torch.finfo(dtype).bits >= torch.finfo(src_dtype).bits:
        return x
    return None


def r_noop(a, n):
    return a.val(n.args[0])


def r_assert_meta(a, n):
    return Dead("an assertion has no value")


def r_view(a, n):
    x = a.val(n.args[0])
    out_shape = a.shape(n)
    numel_in, numel_out = a.ss.numel(n.args[0]), a.ss.numel(n)
    if not a.ss.prove_equal(numel_in, numel_out):
        return None
    if isinstance(x, Grid):
        faxis = _grid_axis(a, out_shape, len(x.cols))
        if faxis is not False:
            return Grid(x.cols, faxis)  # every grid layout flattens to the same (b, j) order
        return None
    if isinstance(x, (Stream, Cond)):
        if all(d == 1 for d in out_shape[1:]) or len(out_shape) == 1:
            return x
        return None
    if isinstance(x, Lookup):
        if len(out_shape) >= 2 and a.is_batch(out_shape[0]) and all(d == 1 for d in out_shape[1:-1]):
            return x
        return None
    if isinstance(x, (EmptyMask, Counts)) and all(d == 1 for d in out_shape[1:]):
        return x
    return None


def r_slice(a, n):
    x = a.val(n.args[0])
    in_shape, out_shape = a.shape(n.args[0]), a.shape(n)
    start = n.args[2] if len(n.args) > 2 else 0
    step = n.args[4] if len(n.args) > 4 else 1
    if start in (0, None) and step == 1 \
            and all(a.ss.prove_equal(p, q) for p, q in zip(in_shape, out_shape, strict=True)):
        return x  # the whole dim: a no-op
    return None


def _grid_axis(a, shape: tuple, f: int):
    """Where the features sit in a grid of this shape: an axis index, None (flattened), False (not a grid)."""
    if not shape:
        return False
    if a.is_batch(shape[0]):
        rest = [i for i in range(1, len(shape)) if shape[i] != 1]
        if not rest:  # [B] or [B, 1, ...]: only a one-feature grid
            return False if f != 1 else (len(shape) - 1 if len(shape) > 1 else None)
        if len(rest) == 1 and shape[rest[0]] == f:
            return rest[0]
        return False
    if a.ss.prove_equal(shape[0], a.batch * f) and all(d == 1 for d in shape[1:]):
        return None
    return False


def _norm(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def r_transpose(a, n):
    x = a.val(n.args[0])
    rank = len(a.shape(n.args[0]))
    if n.target is aten.permute.default:
        perm = [_norm(d, rank) for d in n.args[1]]
    else:
        d0, d1 = _norm(n.args[1], rank), _norm(n.args[2], rank)
        perm = list(range(rank))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    if perm[0] != 0:
        return None  # the batch must stay on axis 0
    if isinstance(x, Grid) and x.faxis is not None:
        return Grid(x.cols, perm.index(x.faxis))
    if isinstance(x, (Stream, Cond)):
        return x  # [B, 1, ...]: moving size-1 axes keeps the order
    return None


def r_select(a, n):
    x = a.val(n.args[0])
    rank = len(a.shape(n.args[0]))
    if not isinstance(x, Grid) or x.flat or _norm(n.args[1], rank) != x.faxis or rank != 2:
        return None
    return x.cols[n.args[2]]


def r_unbind(a, n):
    x = a.val(n.args[0])
    rank = len(a.shape(n.args[0]))
    dim = n.args[1] if len(n.args) > 1 else 0
    if not isinstance(x, Grid) or x.flat or _norm(dim, rank) != x.faxis or rank != 2:
        return None
    return list(x.cols)


def r_index_select(a, n):
    x, dim, idx = a.val(n.args[0]), n.args[1], a.val(n.args[2])
    if isinstance(x, Grid) and isinstance(idx, Const) and not x.flat \
            and _norm(dim, len(a.shape(n.args[0]))) == x.faxis:
        return Grid(tuple(x.cols[int(i)] for i in idx.tensor.tolist()), x.faxis)
    if isinstance(x, UniqueRows) and dim == 0 and isinstance(idx, UniqueOf) and idx.part == "inverse" \
            and idx.stream == x.stream:
        return Rows(x.table, x.stream, via_unique=True)
    return None


def r_getitem(a, n):
    src, i = n.args
    v = a.val(src)
    if isinstance(v, list):
        return v[i]
    if isinstance(v, Bag):
        return v.lookup if i == 0 else Dead(f"output {i} of embedding_bag")
    if isinstance(v, UniqueOf) and v.part == "tuple":
        return UniqueOf(v.stream, ("values", "inverse", "counts")[i])
    return None


def r_arange(a, n):
    c = a.ss.content.get(n)
    if c is not None and a.ss.prove_equal(c.start, 0) and a.ss.prove_equal(c.step, 1) and a.is_batch(c.length):
        return RowIndex()
    return None


def r_cumsum(a, n):
    x = a.val(n.args[0])
    dim = n.args[1]
    if dim == 0 and isinstance(x, Stream) and x.steps == () and x.src.input in a.batch_major and x.src.col is None:
        return Cumsum(x.src.input)
    return None


def r_sub(a, n):
    x, y = a.val(n.args[0]), a.val(n.args[1])
    if isinstance(x, Cumsum) and isinstance(y, Stream) and y.steps == () and y.src.input == x.lengths:
        return Offsets(x.lengths, include_last=False)
    return r_add(a, n)


def r_repeat_interleave(a, n):
    if n.target is aten.repeat_interleave.self_Tensor:
        base, reps = a.val(n.args[0]), a.val(n.args[1])
        if not isinstance(base, RowIndex):
            return None
    else:
        reps = a.val(n.args[0])
    if not (isinstance(reps, Stream) and reps.steps == () and reps.src.input in a.batch_major):
        return None
    out = n.kwargs.get("output_size")
    values = a.input_of_symbol(a.ss.int_of(out)) if out is not None else None
    if values is None:
        return None
    return Seg(Elems(values), reps.src.input)


def r_index(a, n):
    x, idx = a.val(n.args[0]), n.args[1]
    if len(idx) != 1 or idx[0] is None:
        return None
    m = a.val(idx[0])
    if isinstance(m, Cond):
        if isinstance(x, Stream) and x.dom == m.dom and x.fill is None:
            return replace(x, dom=Filt(x.dom, m))
        if isinstance(x, Seg) and x.dom == m.dom:
            return Seg(Filt(x.dom, m), x.lengths)
        return None
    if isinstance(m, EmptyMask) and isinstance(x, RowIndex):
        return EmptyRows(m.dom, m.lengths)
    if isinstance(m, UniqueOf) and m.part == "inverse" and isinstance(x, UniqueRows) and x.stream == m.stream:
        return Rows(x.table, x.stream, via_unique=True)
    return None


def r_cat(a, n):
    parts = [a.val(p) for p in n.args[0]]
    if len(parts) != 2:
        return None
    x, y = parts
    if isinstance(x, Stream) and isinstance(y, Stream) and isinstance(y.dom, EmptyRowsDom) \
            and y.dom.parent == x.dom and x.fill is None:
        return replace(x, dom=Filled(x.dom, y.dom.lengths), fill=y.fill)
    if isinstance(x, Seg) and isinstance(y, EmptyRows) and y.dom == x.dom and y.lengths == x.lengths:
        return Seg(Filled(x.dom, x.lengths), x.lengths)
    return None


def r_unique(a, n):
    x = a.val(n.args[0])
    if not isinstance(x, Stream):
        return None
    return UniqueOf(x, "tuple")


def r_zeros(a, n):
    shape = a.shape(n)
    dtype = n.kwargs.get("dtype") or torch.get_default_dtype()
    return Zeros(tuple(shape), dtype.is_floating_point)


def r_ones(a, n):
    shape = a.shape(n)
    if len(shape) == 1:
        return Ones(shape[0])
    return None


def r_embedding(a, n):
    w, ids = a.val(n.args[0]), a.val(n.args[1])
    if not isinstance(w, Table):
        return None
    if isinstance(ids, UniqueOf) and ids.part == "values":
        return UniqueRows(w.name, ids.stream)
    if not isinstance(ids, Stream):
        return None
    ids_shape = a.shape(n.args[1])
    per_row = isinstance(ids.dom, Elems) and ids.dom.input in a.batch_major and ids.fill is None \
        and len(ids_shape) >= 1 and a.is_batch(ids_shape[0])
    if per_row:
        return Lookup(w.name, ids, "gather")
    return Rows(w.name, ids)


def r_embedding_bag(a, n):
    args = list(n.args)
    w, ids, offsets = (a.val(v) for v in args[:3])
    mode = args[4] if len(args) > 4 else n.kwargs.get("mode", 0)
    psw = args[6] if len(args) > 6 else n.kwargs.get("per_sample_weights")
    include_last = bool(args[7]) if len(args) > 7 else bool(n.kwargs.get("include_last_offset", False))
    padding_idx = args[8] if len(args) > 8 else n.kwargs.get("padding_idx")
    if not isinstance(w, Table) or not isinstance(ids, Stream) or psw is not None or mode not in (0, 1):
        return None
    extra = ()
    if padding_idx is not None and padding_idx >= 0:
        extra = (Remove(IntervalSet.compare("ne", int(padding_idx))),)
    mode_name = "sum" if mode == 0 else "mean"
    proof = a.ss.one_id_per_bag(n)
    if proof is not None and isinstance(ids.dom, Elems) and ids.dom.input in a.batch_major:
        return Bag(Lookup(w.name, ids, "pool", mode_name, one_id_proof=proof, extra_steps=extra))
    if isinstance(offsets, Offsets) and offsets.include_last == include_last and isinstance(ids.dom, Elems) \
            and ids.fill is None:
        return Bag(Lookup(w.name, ids, "pool", mode_name, lengths=offsets.lengths, extra_steps=extra))
    return None


def r_index_add(a, n):
    base, dim, index, source = (a.val(v) for v in n.args[:4])
    alpha = n.kwargs.get("alpha", 1)
    if dim != 0 or alpha != 1 or not isinstance(base, Zeros) or not isinstance(index, Seg):
        return None
    if not base.shape or not a.is_batch(base.shape[0]):
        return None
    if isinstance(source, Ones) and len(base.shape) == 1 and a.ss.prove_equal(source.n, a.ss.numel(n.args[2])):
        return Counts(index.dom, index.lengths)
    if isinstance(source, Rows) and len(base.shape) == 2 and base.is_float:
        s = source.stream
        if s.dom != index.dom:
            return None
        return Lookup(source.table, s, "pool", "sum", lengths=index.lengths, unique=source.via_unique)
    return None


def r_div(a, n):
    x, y = a.val(n.args[0]), a.val(n.args[1])
    if isinstance(x, Lookup) and x.kind == "pool" and x.mode == "sum" and isinstance(y, Counts) \
            and y.dom == x.stream.dom and y.lengths == x.lengths and (y.clamped or isinstance(y.dom, Filled)):
        return replace(x, mode="mean")
    return None


def _zero_empty(a, n, mask: EmptyMask, x, y):
    # where(empty, 0, pooled): the rows that had no id (before any fill) become zeros
    if not (isinstance(x, Like) and x.value == 0 and isinstance(y, Lookup)):
        return None
    dom = y.stream.dom
    base = dom.parent if isinstance(dom, Filled) else dom
    if base != mask.dom or y.lengths != mask.lengths:
        return None
    return replace(y, zero_empty=True)


def r_unsqueeze(a, n):
    x = a.val(n.args[0])
    if isinstance(x, (EmptyMask, Counts)) and n.args[1] in (1, -1):
        return x
    return r_view(a, n)


_RULES: dict[Any, Any] = {
    aten.bucketize.Tensor: r_bucketize,
    aten.remainder.Scalar: r_remainder, aten.remainder.Tensor: r_remainder,
    aten.clamp.default: r_clamp, aten.clamp_min.default: r_clamp, aten.clamp_max.default: r_clamp,
    aten.clip.default: r_clamp,
    aten.add.Scalar: r_add, aten.add.Tensor: r_add, aten.sub.Scalar: r_add, aten.sub.Tensor: r_sub,
    aten.where.self: r_where, aten.masked_fill.Scalar: r_masked_fill, aten.masked_fill.Tensor: r_masked_fill,
    aten.zeros_like.default: r_like, aten.ones_like.default: r_like, aten.full_like.default: r_like,
    aten.to.dtype: r_cast, aten._to_copy.default: r_cast,
    aten.view.default: r_view, aten.reshape.default: r_view, aten._unsafe_view.default: r_view,
    aten.unsqueeze.default: r_unsqueeze, aten.squeeze.dim: r_view, aten.squeeze.dims: r_view,
    aten.flatten.using_ints: r_view,
    aten.slice.Tensor: r_slice, aten.select.int: r_select, aten.unbind.int: r_unbind,
    aten.transpose.int: r_transpose, aten.permute.default: r_transpose,
    aten.index_select.default: r_index_select, aten.index.Tensor: r_index,
    operator.getitem: r_getitem,
    aten.arange.default: r_arange, aten.arange.start: r_arange, aten.arange.start_step: r_arange,
    aten.cumsum.default: r_cumsum,
    aten.repeat_interleave.self_Tensor: r_repeat_interleave, aten.repeat_interleave.Tensor: r_repeat_interleave,
    aten.cat.default: r_cat, aten._unique2.default: r_unique,
    aten.zeros.default: r_zeros, aten.ones.default: r_ones,
    aten.embedding.default: r_embedding,
    aten.index_add.default: r_index_add, aten.div.Tensor: r_div,
    aten._assert_scalar.default: r_assert_meta, aten._assert_tensor_metadata.default: r_assert_meta,
}
for _ops, _rule in ((_CMP, r_compare), (_AND, r_and), (_OR, r_or), (_NOT, r_not), (_NOOP, r_noop),
                    (_BAG_OPS, r_embedding_bag)):
    for _op in _ops:
        _RULES[_op] = _rule
_RULES[recforge_ops.sigrid_hash.default] = r_sigrid
_RULES[recforge_ops.sigrid_hash_multi.default] = r_sigrid


_ELEMENTWISE = {r_bucketize, r_remainder, r_sigrid, r_clamp, r_add, r_sub, r_compare, r_and, r_or, r_not,
                r_where, r_masked_fill, r_cast}

