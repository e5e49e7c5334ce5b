"""Capture: torch.export of an inference module to an ATen graph with a dynamic batch and dynamic lengths.

Batch-major inputs share one ``batch`` Dim and every other tensor input (a jagged column's values) gets its own;
``dynamic_shapes`` says it explicitly when an example is ambiguous. The export settings here keep the export of a
model with a thousand columns affordable. Design and measurements: docs/recom.md#capture.
"""
from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.config as fx_plain_config  # a plain module: no patch()
import torch.fx.experimental._config as fx_config  # patch() comes from install_config_module: untyped
from torch import nn
from torch.utils import _pytree as pytree

from recforge.recom.errors import RecomError


class CaptureError(RecomError, ValueError):
    """The module or its example inputs cannot be captured with dynamic shapes."""


@dataclass
class Capture:
    """An exported program plus what the compiler needs to know about its inputs."""

    program: torch.export.ExportedProgram
    in_spec: pytree.TreeSpec
    input_names: list[str]  # placeholder name of each flat user input, in order
    dynamic_dims: dict[str, str]  # placeholder name -> export symbol of its dynamic dim 0
    batch_size: int
    export_s: float
    example_args: tuple = ()  # the arguments export traced (the example, maybe tiled to 2 rows)
    batch_symbol: str | None = None  # export symbol of the batch dim
    notes: list[str] = field(default_factory=list)


def flat_inputs(args: Sequence[Any]) -> tuple[list[Any], pytree.TreeSpec]:
    return pytree.tree_flatten(tuple(args))


def infer_batch_size(leaves: list[Any]) -> int:
    sizes = Counter(int(t.shape[0]) for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0)
    if not sizes:
        raise CaptureError("example inputs hold no tensor with a dim 0: nothing to make dynamic")
    top = max(sizes.values())
    return min(s for s, n in sizes.items() if n == top)


def _dim_name(path: str, used: set[str]) -> str:
    base = "len_" + (re.sub(r"\W+", "_", path).strip("_") or "x")
    name, i = base, 1
    while name in used:
        i += 1
        name = f"{base}_{i}"
    used.add(name)
    return name


def _tile_batch_major(args: tuple, batch: int, rows: int) -> tuple:
    def tile(t):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            return t.index_select(0, torch.arange(rows) % batch)
        return t

    return pytree.tree_map(tile, args)


def auto_dynamic_shapes(args: tuple, batch: int) -> Any:
    """dynamic_shapes for torch.export: dim 0 of batch-major tensors -> one ``batch`` Dim, others -> own Dims."""
    batch_dim = torch.export.Dim("batch", min=1)
    used: set[str] = {"batch"}
    paths, spec = pytree.tree_flatten_with_path(args)
    out: list[dict[int, Any] | None] = []
    for path, leaf in paths:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            out.append(None)
        elif leaf.shape[0] == batch:
            out.append({0: batch_dim})
        else:
            if leaf.shape[0] < 2:
                raise CaptureError(
                    f"example input {pytree.keystr(path)} has {leaf.shape[0]} element(s) along dim 0; torch.export "
                    "specializes sizes 0 and 1, so give an example with at least 2 (e.g. a non-empty jagged column)"
                )
            out.append({0: torch.export.Dim(_dim_name(pytree.keystr(path), used), min=0)})
    return pytree.tree_unflatten(out, spec)


@contextmanager
def _without_stack_traces() -> Iterator[None]:
    before = fx_plain_config.do_not_emit_stack_traces
    fx_plain_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_plain_config.do_not_emit_stack_traces = before


def capture(module: nn.Module, example_inputs: Sequence[Any], dynamic_batch: bool = True,
            dynamic_shapes: Any = None, size_oblivious: bool = True) -> Capture:
    """torch.export ``module(*example_inputs)`` (eval mode, no grad) with dynamic batch and lengths."""
    args = tuple(example_inputs)
    leaves, in_spec = flat_inputs(args)
    batch = infer_batch_size(leaves)
    notes = []
    batch_used = batch
    if dynamic_shapes is None and dynamic_batch:
        if batch < 2:
            args = _tile_batch_major(args, batch, 2)
            notes.append(f"example batch of {batch} tiled to 2 rows so the batch dim stays symbolic")
            batch_used = 2
        dynamic_shapes = auto_dynamic_shapes(args, batch_used)
    was_training = module.training
    module.eval()
    t0 = time.perf_counter()
    try:
        with (torch.no_grad(),
              fx_config.patch(backed_size_oblivious=size_oblivious),  # type: ignore[attr-defined]  # set up at import
              dynamo_config.patch(fake_tensor_cache_enabled=False),
              _without_stack_traces()):
            ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    finally:
        module.train(was_training)
    export_s = time.perf_counter() - t0
    names = [s.arg.name for s in ep.graph_signature.input_specs
             if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    dims: dict[str, str] = {}
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for name in names:
        val = placeholders[name].meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0 and isinstance(val.shape[0], torch.SymInt):
            dims[name] = str(val.shape[0].node.expr)
    leaves = pytree.tree_leaves(args)
    batch_symbol = None
    for name, leaf in zip(names, leaves, strict=False):
        if name in dims and isinstance(leaf, torch.Tensor) and leaf.shape[0] == batch_used:
            batch_symbol = dims[name]
            break
    return Capture(ep, in_spec, names, dims, batch, export_s, args, batch_symbol, notes)
