"""The residual dense program: the captured graph minus the fused columns, fed the fused layer's output.

Each convergence point (the concat, or the stack torchrec's DLRM uses) is rewritten to read the
fused output: all of it when its inputs are exactly the fused columns in order (no separate concat
left), slices of it otherwise. Nodes only the fused columns needed are gone. The result is a plain
GraphModule, exported again with the same dynamic dims so every backend (export / Inductor / AOTInductor)
can take it. ``onednn_linears`` routes 2-D float32 ``linear`` (+ a following relu) through oneDNN's
``mkldnn._linear_pointwise``: measured 3x the default MKL path on this CPU (bench/bench_recom.py).
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, cast

import torch
from torch import nn
from torch.export.graph_signature import InputKind
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten
EMB_INPUT = "recom_embedding"


def convergence_parts(node: Node) -> list[Node]:
    """The inputs of a cat / stack node: its first argument, a Tensor[] (fx types it as any Argument)."""
    return list(cast("list[Node]", node.args[0]))


def convergence_ok(node: Node) -> bool:
    """A cat over dim 1 of [B, D] parts, or a stack over dim 1: the fused output can stand in."""
    if node.target is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        parts = convergence_parts(node)
        rank = parts[0].meta["val"].dim() if parts else 0
        return bool(rank == 2 and dim in (1, -1))
    if node.target is aten.stack.default:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return bool(dim == 1)
    return False


def _state(ep: torch.export.ExportedProgram) -> dict[str, Any]:
    state = dict(ep.state_dict)
    state.update(getattr(ep, "constants", {}) or {})
    return state


def build_residual(ep: torch.export.ExportedProgram, fused_out: dict[Node, tuple[int, int]],
                   total_dim: int) -> tuple[GraphModule, list[str]]:
    """(GraphModule over [used user inputs..., recom_embedding], names of those user inputs).

    ``fused_out``: the output node of each fused column -> (offset, dim) in the fused output.
    """
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    state = _state(ep)
    converge = {u for n in fused_out for u in n.users}
    needed: set[Node] = set()
    stack = [n for n in ep.graph.nodes if n.op == "output"]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        deps = [a for a in n.all_input_nodes if a not in fused_out] if n in converge else n.all_input_nodes
        stack.extend(deps)
    g = Graph()
    root = nn.Module()
    env: dict[Node, Node] = {}
    user_inputs: list[str] = []
    for n in ep.graph.nodes:
        if n.op != "placeholder" or n not in needed:
            continue
        spec = specs[n.name]
        if spec.kind == InputKind.USER_INPUT:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
            user_inputs.append(n.name)
    emb = g.placeholder(EMB_INPUT)
    for n in ep.graph.nodes:
        if n.op != "placeholder" or n not in needed or specs[n.name].kind == InputKind.USER_INPUT:
            continue
        attr = f"c{len(root._buffers) + len(root._parameters)}"
        value = state[specs[n.name].target]
        if isinstance(value, nn.Parameter):
            root.register_parameter(attr, value)
        else:
            root.register_buffer(attr, value)
        env[n] = g.get_attr(attr)
    batch = None
    for n in ep.graph.nodes:
        if n.op in ("placeholder",) or n not in needed:
            continue
        if n in converge:
            if batch is None:
                batch = g.call_function(aten.sym_size.int, (emb, 0))
            env[n] = _rewrite_convergence(g, n, env, emb, batch, fused_out, total_dim)
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    g.eliminate_dead_code()
    return GraphModule(root, g), user_inputs


def _rewrite_convergence(g: Graph, n: Node, env, emb: Node, batch: Node, fused_out, total_dim: int) -> Node:
    parts = convergence_parts(n)
    pieces: list[Any] = []  # (off, dim) runs of the fused output, or copied nodes
    for p in parts:
        if p in fused_out:
            off, dim = fused_out[p]
            if pieces and isinstance(pieces[-1], tuple) and pieces[-1][0] + pieces[-1][1] == off:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + dim)
            else:
                pieces.append((off, dim))
        else:
            pieces.append(env[p])
    is_stack = n.target is aten.stack.default
    if is_stack:
        dims = {fused_out[p][1] for p in parts if p in fused_out}
        if len(pieces) == 1 and isinstance(pieces[0], tuple) and pieces[0] == (0, total_dim) and len(dims) == 1:
            return g.call_function(aten.view.default, (emb, [batch, len(parts), dims.pop()]))
    if not is_stack and len(pieces) == 1 and isinstance(pieces[0], tuple) and pieces[0] == (0, total_dim):
        return emb  # the fused op already wrote the concatenated output
    nodes = []
    for piece in pieces:
        if isinstance(piece, tuple):
            off, dim = piece
            sl = g.call_function(aten.slice.Tensor, (emb, 1, off, off + dim))
            if is_stack:
                width = next(fused_out[p][1] for p in parts if p in fused_out)
                nodes.append(g.call_function(aten.view.default, (sl, [batch, dim // width, width])))
            else:
                nodes.append(sl)
        else:
            nodes.append(g.call_function(aten.unsqueeze.default, (piece, 1)) if is_stack else piece)
    return g.call_function(aten.cat.default, (nodes, 1))


def onednn_linears(gm: GraphModule, weight_ok=None) -> int:
    """Rewrite 2-D float32 linear (+ relu) to mkldnn._linear_pointwise in place; returns how many."""
    if not torch.backends.mkldnn.is_available():
        return 0
    weight_ok = weight_ok or (lambda w: isinstance(w, Node) and w.op == "get_attr")
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not aten.linear.default:
            continue
        x = n.args[0]
        val = x.meta.get("val") if isinstance(x, Node) else None
        w = n.args[1]
        bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if val is None or val.dim() != 2 or val.dtype != torch.float32 or not weight_ok(w):
            continue
        users = list(n.users)
        fuse_relu = len(users) == 1 and users[0].target is aten.relu.default
        with gm.graph.inserting_after(n):
            new = gm.graph.call_function(torch.ops.mkldnn._linear_pointwise.default,
                                         (x, w, bias, "relu" if fuse_relu else "none", [], ""))
        new.meta = dict((users[0] if fuse_relu else n).meta)
        if fuse_relu:
            users[0].replace_all_uses_with(new)
            gm.graph.erase_node(users[0])
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        count += 1
    gm.graph.lint()
    gm.recompile()
    return count


def with_onednn(ep: torch.export.ExportedProgram) -> tuple[torch.export.ExportedProgram, int]:
    """A copy of ``ep`` (sharing its weight tensors) whose linears run through oneDNN, and how many.

    The copy is for running only: torch.export cannot serialize mkldnn._linear_pointwise, so artifacts
    keep the portable program and this is applied again after loading.
    """
    params = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER}
    memo = {id(t): t for t in list(ep.state_dict.values()) + list((getattr(ep, "constants", {}) or {}).values())}
    with warnings.catch_warnings():  # deepcopy of torch's TreeSpec trips its own LeafSpec deprecation notice
        warnings.simplefilter("ignore", FutureWarning)
        ep2 = copy.deepcopy(ep, memo)
    count = onednn_linears(ep2.graph_module,
                           weight_ok=lambda w: isinstance(w, Node) and w.op == "placeholder" and w.name in params)
    return ep2, count


def export_residual(gm: GraphModule, example: list[torch.Tensor], dims: list[Any]) -> torch.export.ExportedProgram:
    """torch.export the residual with ``dims[i]`` the Dim of input i's dim 0 (None: static)."""
    shapes = tuple({0: d} if d is not None else None for d in dims)
    with torch.no_grad():
        dynamic = shapes if any(d is not None for d in dims) else None
        return torch.export.export(gm, tuple(example), dynamic_shapes=dynamic)
