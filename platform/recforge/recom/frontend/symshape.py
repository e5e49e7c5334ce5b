"""Symbolic shapes of an exported graph with SymEngine (RECom §4).

Every tensor gets a tuple of SymEngine expressions over the input-size symbols: ``B`` for the batch and
``n_<input>`` for each jagged input's length. Rules per ATen op (``_RULES``) derive them; an op without a
rule takes the shape torch.export recorded (converted from SymPy), and the node is listed in
``from_export``. Ops whose output size depends on the data (boolean indexing, unique, nonzero, a
repeat_interleave without output_size) get a fresh symbol with a symbolic upper bound (a boolean index
keeps at most as many elements as its mask has). Small integer tensors whose contents follow from shapes
(``arange``) keep those contents, as RECom's "content known" pattern does. Ops that demand equal sizes
(concat, broadcasting, index_add) unify their symbols (RECom's MakeEq), with a union-find.

Facts proven from these (``prove_equal``, ``one_id_per_bag``) let the compiler turn a pooled lookup into
a gather, see that all columns share one batch, drop shape computations and size the fused layer's
workspace from upper bounds with no device-to-host sync.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import symengine as se
import torch
from torch.fx import Node

import recforge_kernels  # noqa: F401  (torch.ops.recforge.* must exist to key the rules)

aten = torch.ops.aten
Shape = tuple  # tuple[se.Expr, ...]
INT_BIG = 1 << 62  # slice ends at or past this mean "to the end"


@dataclass(frozen=True)
class Arange:
    """Known contents: start, start + step, ..., (length elements)."""

    start: se.Expr
    step: se.Expr
    length: se.Expr


class SymbolicShapes:
    batch: se.Expr | None  # the batch size: its symbol, a number for a static capture, or None

    def __init__(self, ep: torch.export.ExportedProgram, batch_symbol: str | None = None,
                 batch_size: int | None = None):
        self.ep = ep
        self.graph = ep.graph
        self.shape: dict[Node, Any] = {}  # Shape, or a list of Shapes for multi-output ops
        self.value: dict[Node, se.Expr] = {}  # SymInt / int-valued nodes
        self.content: dict[Node, Arange] = {}
        self.upper: dict[se.Symbol, se.Expr] = {}  # bounds of fresh (data-dependent) symbols
        self.fresh_origin: dict[se.Symbol, Node] = {}
        self.from_export: list[Node] = []
        self.unified: list[tuple[se.Expr, se.Expr, Node]] = []
        self.mask_count: dict[Node, se.Symbol] = {}
        self._parent: dict[se.Symbol, se.Symbol] = {}
        self._names: dict[str, se.Symbol] = {}  # export (sympy) symbol name -> ours
        self.input_symbols: dict[str, se.Symbol] = {}  # placeholder -> symbol of its dim 0
        self._bind_inputs(batch_symbol)
        if self.batch is None and batch_size is not None:  # a static capture: the batch is a number
            self.batch = se.Integer(batch_size)
        for node in self.graph.nodes:
            self._infer(node)

    # symbols ---------------------------------------------------------------------------------------
    def _bind_inputs(self, batch_symbol: str | None) -> None:
        user = {s.arg.name for s in self.ep.graph_signature.input_specs
                if s.kind == torch.export.graph_signature.InputKind.USER_INPUT}
        counts: dict[str, int] = {}
        first: dict[str, str] = {}
        for node in self.graph.nodes:
            if node.op != "placeholder" or node.name not in user:
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[0], torch.SymInt):
                name = str(val.shape[0].node.expr)
                counts[name] = counts.get(name, 0) + 1
                first.setdefault(name, node.name)
        batch = batch_symbol or (max(counts, key=lambda k: counts[k]) if counts else None)
        for name, holder in first.items():
            self._names[name] = se.Symbol("B" if name == batch else f"n_{holder}")
        self.batch = self._names.get(batch) if batch else None

    def fresh(self, node: Node, upper: se.Expr | None) -> se.Symbol:
        sym = se.Symbol(f"u_{node.name}")
        self.fresh_origin[sym] = node
        if upper is not None:
            self.upper[sym] = upper
        return sym

    def _find(self, s: se.Symbol) -> se.Symbol:
        while s in self._parent:
            s = self._parent[s]
        return s

    def canon(self, e: se.Expr) -> se.Expr:
        e = se.sympify(e)
        subs = {s: self._find(s) for s in e.free_symbols if s in self._parent}
        return se.expand(e.subs(subs)) if subs else e

    def unify(self, a: se.Expr, b: se.Expr, node: Node) -> None:
        """Record a == b, demanded by ``node``; two bare symbols are merged (the older one survives)."""
        a, b = self.canon(a), self.canon(b)
        if se.expand(a - b) == 0:
            return
        self.unified.append((a, b, node))
        if isinstance(a, se.Symbol) and isinstance(b, se.Symbol):
            keep, drop = (a, b) if self._rank(a) <= self._rank(b) else (b, a)
            self._parent[drop] = keep

    def _rank(self, s: se.Symbol) -> tuple:
        name = str(s)
        return (0 if name == "B" else 1 if name.startswith("n_") else 2, name)

    def from_sympy(self, e: Any) -> se.Expr:
        if isinstance(e, int):
            return se.Integer(e)
        if isinstance(e, torch.SymInt):
            e = e.node.expr
        expr = se.sympify(e)
        subs = {}
        for s in expr.free_symbols:
            name = str(s)
            if name not in self._names:
                self._names[name] = se.Symbol(f"x_{name}")
            subs[s] = self._names[name]
        return self.canon(expr.subs(subs)) if subs else expr

    # queries -----------------------------------------------------------------------------------------
    def shape_of(self, arg: Any, index: int | None = None) -> Shape:
        s = self.shape[arg]
        if isinstance(s, list):
            return s[0 if index is None else index]
        return tuple(self.canon(d) for d in s)

    def numel(self, arg: Any) -> se.Expr:
        out = se.Integer(1)
        for d in self.shape_of(arg):
            out = out * d
        return se.expand(out)

    def int_of(self, arg: Any) -> se.Expr:
        """A size argument: a Python int or a SymInt-producing node."""
        if isinstance(arg, Node):
            if arg not in self.value:
                raise KeyError(f"{arg.name} is not a known integer")
            return self.canon(self.value[arg])
        if isinstance(arg, bool):
            return se.Integer(int(arg))
        if isinstance(arg, (int, torch.SymInt)):
            return self.from_sympy(arg)
        raise TypeError(f"not an integer argument: {arg!r}")

    def prove_equal(self, a: se.Expr, b: se.Expr) -> bool:
        return se.expand(self.canon(a) - self.canon(b)) == 0

    def upper_bound(self, e: se.Expr, depth: int = 8) -> se.Expr:
        """Replace each fresh symbol by its upper bound (sizes are >= 0, so a sum with non-negative
        coefficients only grows); raises if a fresh symbol has no bound."""
        e = self.canon(e)
        for _ in range(depth):
            fresh = [s for s in e.free_symbols if str(s).startswith("u_")]
            if not fresh:
                return e
            for s in fresh:
                if s not in self.upper:
                    raise ValueError(f"no upper bound for {s} (from node {self.fresh_origin[s].name})")
                if se.expand(e).coeff(s).is_Number and se.expand(e).coeff(s) < 0:
                    raise ValueError(f"{s} appears with a negative coefficient in {e}: no upper bound")
            e = se.expand(e.subs({s: self.upper[s] for s in fresh}))
        raise ValueError(f"upper bound of {e} does not close")

    def one_id_per_bag(self, bag: Node) -> str | None:
        """A proof string when an embedding_bag node reads exactly one id per bag, else None."""
        ids, offsets = bag.args[1], bag.args[2]
        include_last = bool(bag.args[7]) if len(bag.args) > 7 else bool(bag.kwargs.get("include_last_offset", False))
        if include_last or not isinstance(offsets, Node) or offsets not in self.content:
            return None
        c = self.content[offsets]
        n = self.numel(ids)
        if (self.prove_equal(c.start, 0) and self.prove_equal(c.step, 1) and self.prove_equal(c.length, n)
                and len(self.shape_of(ids)) == 1):
            return (f"offsets = arange(0, {c.length}, 1) and ids has {n} elements: "
                    f"bag i = ids[i:i+1], exactly one id per bag")
        return None

    # inference -----------------------------------------------------------------------------------------
    def _infer(self, node: Node) -> None:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                self.shape[node] = tuple(self.from_sympy(d) for d in val.shape)
            elif isinstance(val, (int, torch.SymInt)):
                self.value[node] = self.from_sympy(val)
            return
        if node.op != "call_function":
            return
        rule = _RULES.get(node.target)
        if rule is not None:
            try:
                rule(self, node)
                return
            except (KeyError, TypeError, ValueError, IndexError):
                pass  # an argument outside the rule's cases: take export's answer
        self._from_meta(node)

    def _from_meta(self, node: Node) -> None:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            self.shape[node] = tuple(self.from_sympy(d) for d in val.shape)
        elif isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
            self.shape[node] = [tuple(self.from_sympy(d) for d in v.shape) for v in val]
        elif isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool):
            self.value[node] = self.from_sympy(val)
        else:
            return
        if node.target is not operator.getitem:
            self.from_export.append(node)


def _broadcast(ctx: SymbolicShapes, node: Node, shapes: list[Shape]) -> Shape:
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        sizes = [d for d in dims if not (d.is_Number and int(d) == 1)]
        if not sizes:
            out.append(se.Integer(1))
            continue
        for d in sizes[1:]:
            ctx.unify(sizes[0], d, node)
        out.append(ctx.canon(sizes[0]))
    return tuple(out)


def _tensor_args(node: Node) -> list[Node]:
    return [a for a in node.args if isinstance(a, Node)]


def _same(ctx, node):
    ctx.shape[node] = ctx.shape_of(node.args[0])


def _pointwise(ctx, node):
    shapes = [ctx.shape_of(a) for a in _tensor_args(node) if a in ctx.shape]
    ctx.shape[node] = _broadcast(ctx, node, shapes)


def _sizes(ctx, arg) -> Shape:
    return tuple(ctx.int_of(d) for d in arg)


def _new(ctx, node):  # zeros / ones / empty / full (size, ...)
    ctx.shape[node] = _sizes(ctx, node.args[0])


def _reshape(ctx, node):
    src = ctx.shape_of(node.args[0])
    target = list(node.args[1])
    total = se.Integer(1)
    for d in src:
        total = total * d
    dims = [None if (isinstance(d, int) and d == -1) else ctx.int_of(d) for d in target]
    if dims.count(None) > 1:
        raise ValueError("more than one -1")
    if None in dims:
        known = se.Integer(1)
        for d in dims:
            if d is not None:
                known = known * d
        missing = se.expand(total / known)
        if any(isinstance(t, se.Pow) and t.exp.is_Number and t.exp < 0 for t in se.Add.make_args(missing)):
            raise ValueError("inexact -1")
        dims[dims.index(None)] = missing
    else:
        new_total = se.Integer(1)
        for d in dims:
            new_total = new_total * d
        ctx.unify(se.expand(total), se.expand(new_total), node)
    ctx.shape[node] = tuple(ctx.canon(d) for d in dims)


def _norm_dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _unsqueeze(ctx, node):
    s = list(ctx.shape_of(node.args[0]))
    s.insert(_norm_dim(node.args[1], len(s) + 1), se.Integer(1))
    ctx.shape[node] = tuple(s)


def _squeeze_dim(ctx, node):
    s = list(ctx.shape_of(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else list(range(len(s)))
    dims = [dims] if isinstance(dims, int) else list(dims)
    drop = {_norm_dim(d, len(s)) for d in dims if s and s[_norm_dim(d, len(s))] == 1}
    ctx.shape[node] = tuple(d for i, d in enumerate(s) if i not in drop)


def _transpose(ctx, node):
    s = list(ctx.shape_of(node.args[0]))
    if node.target is aten.permute.default:
        perm = [_norm_dim(d, len(s)) for d in node.args[1]]
    else:
        d0, d1 = _norm_dim(node.args[1], len(s)), _norm_dim(node.args[2], len(s))
        perm = list(range(len(s)))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    ctx.shape[node] = tuple(s[p] for p in perm)


def _select(ctx, node):
    s = list(ctx.shape_of(node.args[0]))
    del s[_norm_dim(node.args[1], len(s))]
    ctx.shape[node] = tuple(s)


def _unbind(ctx, node):
    s = list(ctx.shape_of(node.args[0]))
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(s))
    n = s[dim]
    if not n.is_Number:
        raise ValueError("unbind of a symbolic dim")
    rest = tuple(d for i, d in enumerate(s) if i != dim)
    ctx.shape[node] = [rest] * int(n)


def _slice(ctx, node):
    s = list(ctx.shape_of(node.args[0]))
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(s))
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    start_e = se.Integer(0) if start is None else ctx.int_of(start)
    if end is None or (isinstance(end, int) and end >= INT_BIG):
        end_e = s[dim]
    else:
        end_e = ctx.int_of(end)
        if not (end_e.is_Number and s[dim].is_Number):
            raise ValueError("symbolic slice end")
        end_e = se.Integer(min(int(end_e), int(s[dim])))
    if step != 1 or not (start_e.is_Number and int(start_e) >= 0):
        raise ValueError("slice with a step or a negative start")
    s[dim] = se.expand(end_e - start_e)
    ctx.shape[node] = tuple(s)


def _index_select(ctx, node):
    s = list(ctx.shape_of(node.args[0]))
    dim = _norm_dim(node.args[1], len(s))
    s[dim] = ctx.numel(node.args[2])
    ctx.shape[node] = tuple(s)


def _index(ctx, node):
    src = ctx.shape_of(node.args[0])
    indices = node.args[1]
    if len(indices) != 1 or not isinstance(indices[0], Node):
        raise ValueError("only a single index tensor")
    idx = indices[0]
    dtype = idx.meta["val"].dtype
    if dtype == torch.bool:
        mask = ctx.shape_of(idx)
        for a, b in zip(mask, src, strict=False):
            ctx.unify(a, b, node)
        bound = se.Integer(1)
        for d in mask:
            bound = bound * d
        if idx not in ctx.mask_count:  # one mask keeps the same number of elements of every tensor it indexes
            ctx.mask_count[idx] = ctx.fresh(node, se.expand(bound))
        ctx.shape[node] = (ctx.mask_count[idx], *src[len(mask):])
    else:
        ctx.shape[node] = (*ctx.shape_of(idx), *src[1:])


def _embedding(ctx, node):
    ctx.shape[node] = (*ctx.shape_of(node.args[1]), ctx.shape_of(node.args[0])[1])


def _embedding_bag(ctx, node):
    weight, offsets = node.args[0], node.args[2]
    include_last = bool(node.args[7]) if len(node.args) > 7 else False
    bags = ctx.numel(offsets) - (1 if include_last else 0)
    out = (se.expand(bags), ctx.shape_of(weight)[1])
    meta = node.meta.get("val")
    aux = [tuple(ctx.from_sympy(d) for d in v.shape) for v in meta[1:]] if meta else []
    ctx.shape[node] = [out, *aux]


def _cat(ctx, node):
    tensors = [t for t in node.args[0] if ctx.shape_of(t) != (0,)]
    dim = node.args[1] if len(node.args) > 1 else 0
    shapes = [ctx.shape_of(t) for t in tensors]
    rank = len(shapes[0])
    dim = _norm_dim(dim, rank)
    total = se.Integer(0)
    for s in shapes:
        total = total + s[dim]
    out = list(shapes[0])
    for s in shapes[1:]:
        for i in range(rank):
            if i != dim:
                ctx.unify(out[i], s[i], node)
    out = [ctx.canon(d) for d in out]
    out[dim] = se.expand(total)
    ctx.shape[node] = tuple(out)


def _stack(ctx, node):
    shapes = [ctx.shape_of(t) for t in node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else 0
    for s in shapes[1:]:
        for a, b in zip(shapes[0], s, strict=True):
            ctx.unify(a, b, node)
    out = [ctx.canon(d) for d in shapes[0]]
    out.insert(_norm_dim(dim, len(out) + 1), se.Integer(len(shapes)))
    ctx.shape[node] = tuple(out)


def _arange(ctx, node):
    args = list(node.args)
    if node.target is aten.arange.default:
        start, end, step = se.Integer(0), ctx.int_of(args[0]), se.Integer(1)
    else:
        start, end = ctx.int_of(args[0]), ctx.int_of(args[1])
        step = ctx.int_of(args[2]) if len(args) > 2 else se.Integer(1)
    if not (step.is_Number and int(step) > 0):
        raise ValueError("arange with a symbolic or non-positive step")
    length = se.expand(end - start) if int(step) == 1 else se.ceiling((end - start) / step)
    ctx.shape[node] = (length,)
    ctx.content[node] = Arange(start, step, length)


def _repeat_interleave(ctx, node):
    out_size = node.kwargs.get("output_size")
    if out_size is not None:
        ctx.shape[node] = (ctx.int_of(out_size),)
    else:
        ctx.shape[node] = (ctx.fresh(node, None),)


def _unique2(ctx, node):
    src = ctx.shape_of(node.args[0])
    n = ctx.numel(node.args[0])
    u = ctx.fresh(node, n)
    inverse = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("return_inverse", False))
    counts = bool(node.args[3]) if len(node.args) > 3 else bool(node.kwargs.get("return_counts", False))
    ctx.shape[node] = [(u,), tuple(src) if inverse else (se.Integer(0),), (u,) if counts else (se.Integer(0),)]


def _index_add(ctx, node):
    s = ctx.shape_of(node.args[0])
    dim = _norm_dim(node.args[1], len(s))
    ctx.unify(ctx.numel(node.args[2]), ctx.shape_of(node.args[3])[dim], node)
    ctx.shape[node] = s


def _linear(ctx, node):
    x, w = ctx.shape_of(node.args[0]), ctx.shape_of(node.args[1])
    ctx.unify(x[-1], w[1], node)
    ctx.shape[node] = (*x[:-1], w[0])


def _getitem(ctx, node):
    src, i = node.args
    if src in ctx.shape and isinstance(ctx.shape[src], list):
        ctx.shape[node] = tuple(ctx.canon(d) for d in ctx.shape[src][i])
        return
    raise KeyError("not a multi-output node")


def _sym_size(ctx, node):
    ctx.value[node] = ctx.shape_of(node.args[0])[_norm_dim(node.args[1], len(ctx.shape_of(node.args[0])))]


def _sym_arith(fn: Callable) -> Callable:
    def rule(ctx, node):
        a, b = (ctx.int_of(x) for x in node.args)
        ctx.value[node] = se.expand(fn(a, b))
    return rule


def _no_output(ctx, node):
    pass


_POINTWISE_SAME = [
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.clip.default, aten.bucketize.Tensor,
    aten.remainder.Scalar, aten.ge.Scalar, aten.gt.Scalar, aten.le.Scalar, aten.lt.Scalar, aten.eq.Scalar,
    aten.ne.Scalar, aten.bitwise_not.default, aten.logical_not.default, aten.neg.default, aten.abs.default,
    aten.relu.default, aten.sigmoid.default, aten.to.dtype, aten._to_copy.default, aten.clone.default,
    aten.alias.default, aten.detach.default, aten.contiguous.default, aten.zeros_like.default,
    aten.ones_like.default, aten.full_like.default, aten.empty_like.default, aten.log.default,
    aten.rsub.Scalar, aten.masked_fill.Scalar, aten.cumsum.default, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.lift_fresh_copy.default,
]
_CUSTOM_SAME = ("sigrid_hash", "sigrid_hash_multi")
_POINTWISE_BROADCAST = [
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.where.self, aten.__and__.Tensor,
    aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_and.default,
    aten.logical_or.default, aten.eq.Tensor, aten.ne.Tensor, aten.ge.Tensor, aten.gt.Tensor, aten.le.Tensor,
    aten.lt.Tensor, aten.masked_fill.Tensor, aten.remainder.Tensor, aten.maximum.default, aten.minimum.default,
    aten.where.ScalarOther, aten.where.ScalarSelf,
]

_RULES: dict[object, Callable] = {}
for _op in _POINTWISE_SAME:
    _RULES[_op] = _same
for _op in _POINTWISE_BROADCAST:
    _RULES[_op] = _pointwise
for _name in _CUSTOM_SAME:
    _packet = getattr(torch.ops.recforge, _name, None)
    if _packet is not None:
        _RULES[_packet.default] = _same
_RULES.update({
    aten.zeros.default: _new, aten.ones.default: _new, aten.empty.memory_format: _new, aten.full.default: _new,
    aten.view.default: _reshape, aten.reshape.default: _reshape, aten._unsafe_view.default: _reshape,
    aten.unsqueeze.default: _unsqueeze, aten.squeeze.dim: _squeeze_dim, aten.squeeze.dims: _squeeze_dim,
    aten.select.int: _select, aten.unbind.int: _unbind, aten.slice.Tensor: _slice,
    aten.transpose.int: _transpose, aten.permute.default: _transpose,
    aten.index_select.default: _index_select, aten.index.Tensor: _index,
    aten.embedding.default: _embedding,
    aten.embedding_bag.default: _embedding_bag, aten.embedding_bag.padding_idx: _embedding_bag,
    aten._embedding_bag.default: _embedding_bag, aten._embedding_bag_forward_only.default: _embedding_bag,
    aten.cat.default: _cat, aten.stack.default: _stack,
    aten.arange.default: _arange, aten.arange.start: _arange, aten.arange.start_step: _arange,
    aten.repeat_interleave.self_Tensor: _repeat_interleave, aten.repeat_interleave.Tensor: _repeat_interleave,
    aten._unique2.default: _unique2, aten.index_add.default: _index_add, aten.linear.default: _linear,
    operator.getitem: _getitem, aten.sym_size.int: _sym_size,
    operator.add: _sym_arith(operator.add), operator.sub: _sym_arith(operator.sub),
    operator.mul: _sym_arith(operator.mul),
    aten._assert_scalar.default: _no_output, aten._assert_tensor_metadata.default: _no_output,
})
