"""The compile seam: ``compile(module, example_inputs) -> CompiledModel``, a torch.nn.Module matching eager.

Capture with torch.export (``capture.py``), fuse the embedding columns into one ``recforge::embedding_layer`` call
(``column_compiler.py``), run the residual dense program under a backend (``"export"``, ``"inductor"``,
``"aoti"`` or ``"auto"``) and check the result against eager; ``save``/``load`` (``artifact.py``) write one file.
The steps: docs/recom.md#how-recforge-implements-it.
"""
from __future__ import annotations

import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

import recforge_kernels.embedding_op  # noqa: F401  (registers the recforge ops exported graphs call)
from recforge.recom.artifact import load_compiled, save_compiled
from recforge.recom.backend.column_compiler import compile_columns
from recforge.recom.backend.dense import EMB_INPUT, build_residual, export_residual, with_onednn
from recforge.recom.backend.layer import FusedEmbeddingLayer
from recforge.recom.errors import CompileMismatchError
from recforge.recom.frontend.capture import capture, infer_batch_size
from recforge.recom.frontend.graph_stats import count_lookups, dispatched_ops, graph_ops

Backend = Literal["auto", "export", "inductor", "aoti"]
BACKENDS: tuple[str, ...] = ("auto", "export", "inductor", "aoti")
# bench/bench_compile.py (criteo_kaggle, 26 tables, 1 thread, CPU): AOTInductor is the fastest correct backend
# at B = 1, 64 and 1024 for the DLRM; "auto" = AOTInductor, falling back to the plain exported graph (with a
# warning and the reason in metadata["backend_fallback"]) where it cannot build (no C++ toolchain).
DEFAULT_BACKEND: Backend = "auto"


def batch_size_of(inputs: Sequence[Any]) -> int:
    """The batch size of an input tuple: the dim-0 size shared by most tensor leaves (jagged values differ)."""
    leaves = pytree.tree_leaves(tuple(inputs))
    if not any(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
        raise ValueError("example_inputs hold no tensor with a batch dimension")
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) > 1 and all(isinstance(t, torch.Tensor) for t in inputs) and len(inputs) == len(leaves):
        raise ValueError(f"example_inputs must be tensors sharing one batch size (dim 0); got sizes {sorted(sizes)}")
    return infer_batch_size(leaves)


def tile_rows(inputs: Sequence[Any], n: int) -> tuple:
    """Repeat rows cyclically to exactly ``n`` rows (batch-major tensors; for jagged requests use
    ``recforge.recom.family.select_rows``)."""
    out = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            idx = torch.arange(n, device=t.device) % t.shape[0]
            t = t.index_select(0, idx)
        out.append(t)
    return tuple(out)


def export_program(module: nn.Module, example_inputs: Sequence[Any],
                   dynamic_batch: bool = True) -> torch.export.ExportedProgram:
    """torch.export with dim 0 of every tensor input bound to one dynamic ``batch`` Dim."""
    inputs = tuple(example_inputs)
    if dynamic_batch and batch_size_of(inputs) < 2:
        inputs = tile_rows(inputs, 2)
    dynamic_shapes = None
    if dynamic_batch:
        batch = torch.export.Dim("batch", min=1)
        dynamic_shapes = tuple({0: batch} if isinstance(t, torch.Tensor) and t.dim() > 0 else None for t in inputs)
    with eval_mode(module), torch.no_grad():
        return torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes)


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Put ``module`` in eval mode for the block and restore its training flag after."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def _make_runner(ep: torch.export.ExportedProgram, graph_module: nn.Module, backend: str, dynamic_batch: bool):
    """Returns (callable, keepalive) for a concrete backend."""
    if backend == "export":
        return graph_module, None
    if backend == "inductor":
        return torch.compile(graph_module, backend="inductor", dynamic=dynamic_batch), None
    if backend == "aoti":
        workdir = tempfile.TemporaryDirectory(prefix="recforge-aoti-")
        package = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(workdir.name, "model.pt2"))
        return torch._inductor.aoti_load_package(package), workdir
    raise ValueError(f"backend: unknown {backend!r}; choose one of {list(BACKENDS)}")


class CompiledModel(nn.Module):
    """A compiled model; ``forward`` takes the example inputs' layout (same pytree structure).

    With fused columns: ``layer`` (a FusedEmbeddingLayer) computes the embedding layer in one op and
    ``exported_program`` is the residual dense program (inputs: the user inputs it still reads, then the
    fused output). Without: ``exported_program`` is the captured program, run on the inputs as given.

    ``backend`` is the one running ("export", "inductor" or "aoti"); ``metadata``: requested_backend,
    backend, backend_fallback, dynamic_batch, example_batch, num_columns / num_tables, ops_before /
    ops_after (ATen ops one forward of the source / of the captured graph dispatches), ops_compiled
    (of this model), graph_nodes, lookups_before / num_embedding_lookups, op_histogram, export_s,
    column_compile_s, backend_compile_s, example_max_abs_diff, recom (the column compiler's report).
    """

    # set with object.__setattr__ in __init__ (kept out of the submodules)
    _runner: Callable[..., Any]
    _keepalive: Any
    _fallback: nn.Module | None

    def __init__(self, exported_program: torch.export.ExportedProgram, backend: str = DEFAULT_BACKEND,
                 metadata: dict[str, Any] | None = None, warmup_inputs: Sequence[Any] | None = None, *,
                 layer: FusedEmbeddingLayer | None = None, in_spec: pytree.TreeSpec | None = None,
                 dense_index: Sequence[int] | None = None, input_names: Sequence[str] | None = None,
                 out_spec: pytree.TreeSpec | None = None, fallback: nn.Module | None = None,
                 onednn: bool = False):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend: unknown {backend!r}; choose one of {list(BACKENDS)}")
        self.exported_program = exported_program  # portable: what save() writes
        self.metadata: dict[str, Any] = dict(metadata or {})
        running = exported_program
        self.metadata["onednn"] = bool(onednn)
        if onednn and backend != "inductor":  # Inductor's lowering wants its own (prepacked) mkldnn linears
            running, self.metadata["onednn_linears"] = with_onednn(exported_program)
        else:
            self.metadata["onednn_linears"] = 0
        self.running_program = running
        self.graph_module = running.module()
        self.layer = layer
        self.in_spec = in_spec
        self.out_spec = out_spec  # the source module's output structure (the residual returns a flat tuple)
        self.dense_index = list(dense_index) if dense_index is not None else None
        self.input_names = list(input_names) if input_names is not None else None
        object.__setattr__(self, "_fallback", fallback)  # the source module, in this process only
        self.metadata.pop("backend_fallback", None)
        self.metadata["requested_backend"] = backend
        dynamic = bool(self.metadata.get("dynamic_batch", True))
        t0 = time.perf_counter()
        if backend == "auto":
            try:
                runner, keepalive = _make_runner(running, self.graph_module, "aoti", dynamic)
                backend = "aoti"
            except Exception as e:  # no toolchain, unsupported op, ...: the exported graph still runs
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
                warnings.warn(f"recforge.recom: AOTInductor failed ({reason}); running the exported graph",
                              stacklevel=2)
                self.metadata["backend_fallback"] = reason
                runner, keepalive, backend = self.graph_module, None, "export"
        else:
            runner, keepalive = _make_runner(running, self.graph_module, backend, dynamic)
        self.backend = backend
        self.metadata["backend"] = backend
        # Not registered as submodules: they wrap graph_module (or are not Modules at all).
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_keepalive", keepalive)
        if warmup_inputs is not None and backend == "inductor":
            self(*warmup_inputs)  # pay torch.compile's compile here, in the compile stage
            if dynamic and self.layer is None:  # Dynamo specializes size-1 dims: compile B=1 now too
                self(*tile_rows(tuple(warmup_inputs), 1))
        self.metadata["backend_compile_s"] = round(time.perf_counter() - t0, 3)

    @property
    def batch_bounds(self) -> tuple[int, int]:
        """Batch sizes this model runs (a static capture runs only its example's)."""
        if self.metadata.get("dynamic_batch", True):
            return 1, 2**62
        b = int(self.metadata["example_batch"])
        return b, b

    @property
    def fused(self) -> bool:
        return self.layer is not None

    def _flatten(self, inputs: tuple) -> list[Any]:
        keys = self.__dict__.get("_dict_keys")
        if keys is None and self.in_spec is not None:
            self.__dict__["_dict_keys"] = keys = _single_dict_keys(self.in_spec)
        if keys and len(inputs) == 1 and type(inputs[0]) is dict and len(inputs[0]) == len(keys):
            d = inputs[0]  # a request dict: its values are the leaves (1,000+ columns: skip the pytree walk)
            if list(d) == keys:
                return list(d.values())
            if d.keys() == set(keys):
                return [d[k] for k in keys]
        leaves, spec = pytree.tree_flatten(inputs)
        if self.in_spec is not None and spec != self.in_spec:
            raise ValueError(
                "recforge.recom: inputs do not have the structure the model was compiled for "
                f"(expected {self.in_spec}, got {spec})"
            )
        return leaves

    def forward(self, *inputs: Any) -> torch.Tensor:
        with torch.no_grad():
            if self.layer is None:
                return self._runner(*inputs)
            leaves = self._flatten(inputs)
            batch = leaves[self.layer.batch_index].shape[0]
            lo, hi = self.batch_bounds
            if not lo <= batch <= hi:
                return self._out_of_bounds(
                    inputs,
                    f"a batch of {batch} rows is outside the compiled bounds [{lo}, {hi if hi < 2**62 else 'inf'}]")
            emb = self.layer(leaves)
            if self.__dict__.get("_identity_dense") is None:
                self.__dict__["_identity_dense"] = _returns_embedding(self.exported_program) and (
                    self.out_spec is None or self.out_spec.is_leaf())
            if self._identity_dense:  # the model is the embedding layer: nothing after the fused op
                return emb
            assert self.dense_index is not None  # given with the layer
            out = self._runner(*[leaves[i] for i in self.dense_index], emb)
            if self.out_spec is not None:
                out = pytree.tree_unflatten(list(out), self.out_spec)
            return out

    def _out_of_bounds(self, inputs: tuple, why: str) -> torch.Tensor:
        policy = self.metadata.get("out_of_bounds", "error")
        if policy == "error" or self._fallback is None:
            raise ValueError(f"recforge.recom: {why} (compile with out_of_bounds='eager' or 'recompile' to "
                             "run such inputs)")
        if policy == "recompile":
            return self._recompiled(inputs, why)(*inputs)
        warnings.warn(f"recforge.recom: {why}; running the eager module", stacklevel=3)
        self.metadata["fallback_calls"] = self.metadata.get("fallback_calls", 0) + 1
        return self._fallback(*inputs)

    def _recompiled(self, inputs: tuple, why: str) -> CompiledModel:
        """A compile of the source module for these inputs' batch size (cached per size), like
        torch.compile's recompilation on a new static shape."""
        assert self._fallback is not None  # _out_of_bounds recompiles only with a source module
        leaves = pytree.tree_leaves(inputs)
        key = int(leaves[self.layer.batch_index].shape[0]) if self.layer is not None else batch_size_of(inputs)
        cache = self.__dict__.setdefault("_recompiles", {})
        if key not in cache:
            if key < 1:
                raise ValueError(f"recforge.recom: {why}; no compile exists for an empty batch")
            warnings.warn(f"recforge.recom: {why}; recompiling for {key} rows", stacklevel=4)
            opts = self.metadata.get("compile_options", {})
            cache[key] = compile(self._fallback, inputs, **opts)
            self.metadata["recompiles"] = self.metadata.get("recompiles", 0) + 1
        return cache[key]

    def save(self, path: str | os.PathLike) -> Path:
        return save(self, path)


def _returns_embedding(ep: torch.export.ExportedProgram) -> bool:
    """The residual program only hands the fused output back (its one output is that input)."""
    out = next(n for n in ep.graph.nodes if n.op == "output")
    values = pytree.tree_leaves(out.args)
    return len(values) == 1 and getattr(values[0], "op", None) == "placeholder" and values[0].name == EMB_INPUT


def _single_dict_keys(spec: pytree.TreeSpec) -> list[Any] | None:
    """The keys when the inputs are one flat dict of tensors (a request of named columns), else []."""
    try:
        if spec.num_children != 1:
            return []
        child = spec.child(0)
        if child.type is not dict or any(not c.is_leaf() for c in child.children()):
            return []
        return list(child.context)
    except AttributeError:
        return []


def _describe(module: nn.Module) -> dict[str, int]:
    cols = getattr(module, "columns", None)
    if not cols or not hasattr(next(iter(cols), None), "table"):
        return {}
    return {"num_columns": len(cols), "num_tables": len({c.table for c in cols})}


def compile(module: nn.Module, example_inputs: Sequence[Any], dynamic_batch: bool = True,
            backend: Backend = DEFAULT_BACKEND, atol: float = 1e-5, *, dynamic_shapes: Any = None,
            fuse_columns: bool = True, onednn: bool = True, out_of_bounds: str = "error",
            size_oblivious: bool = True) -> CompiledModel:
    """Compile ``module`` (an InferenceModule is first lowered to its gather form) for inference.

    ``dynamic_shapes`` overrides the inferred dynamic dims (see ``capture.py``); ``fuse_columns=False``
    skips the column compiler; ``onednn=False`` keeps the dense net's linears as captured;
    ``out_of_bounds`` says what a call outside the compiled bounds (another batch size after a static
    capture, an empty batch) does: "error" (ValueError), "eager" (run ``module``, with a warning) or
    "recompile" (compile again for that batch size, cached); ``size_oblivious`` captures with size-oblivious
    reasoning (see ``capture.py``; a model whose Python code branches on "batch == 1" needs False). The result
    is checked against ``module`` on ``example_inputs`` and, when every input is batch-major, on its first row
    too (CompileMismatchError above ``atol``). Raises
    NotOneHotError when an InferenceModule's one-id-per-row cannot be proven.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; choose one of {list(BACKENDS)}")
    if out_of_bounds not in ("error", "eager", "recompile"):
        raise ValueError(f"out_of_bounds: unknown {out_of_bounds!r}; choose 'error', 'eager' or 'recompile'")
    inputs = tuple(example_inputs)
    lowered = getattr(module, "lowered", None)
    target = lowered() if lowered is not None else module
    dims, traced = dynamic_shapes, inputs
    hint = getattr(target, "dynamic_shapes_for", None)
    if dims is None and dynamic_batch and callable(hint):  # a model with list columns names its own dims
        dims = hint(inputs)
        if dims is not None:  # and traces a copy without sizes 0 / 1 (InferenceModule.export_example)
            traced = getattr(target, "export_example")(inputs)  # noqa: B009  (nn.Module's __getattr__ types)
    with eval_mode(module), eval_mode(target):
        before = dispatched_ops(module, inputs)
        cap = capture(target, traced, dynamic_batch=dynamic_batch, dynamic_shapes=dims,
                      size_oblivious=size_oblivious)
        ep = cap.program
        nodes = graph_ops(ep.graph_module)
        after = dispatched_ops(ep.graph_module, tuple(_lifted_args(ep, pytree.tree_leaves(inputs))))
        metadata = {
            "dynamic_batch": dynamic_batch,
            "example_batch": cap.batch_size,
            **_describe(target),
            "ops_before": sum(before.values()),
            "ops_after": sum(after.values()),
            "graph_nodes": sum(nodes.values()),
            "lookups_before": count_lookups(before),
            "num_embedding_lookups": count_lookups(nodes),
            "op_histogram": dict(sorted(nodes.items())),
            "export_s": round(cap.export_s, 3),
            "capture_notes": cap.notes + ([] if traced is inputs else [
                "traced on a copy of the example with at least 2 rows and 2 values per list column"]),
            **_aliases(target, cap.input_names),
            "out_of_bounds": out_of_bounds,
            "compile_options": {"dynamic_batch": dynamic_batch, "backend": backend, "atol": atol,
                                "fuse_columns": fuse_columns, "onednn": onednn, "out_of_bounds": out_of_bounds,
                                "size_oblivious": size_oblivious},
        }
        t0 = time.perf_counter()
        cc = compile_columns(cap) if fuse_columns else None
        layer, emb, kernel_error = None, None, None
        if cc is not None and cc.plan is not None:
            layer = FusedEmbeddingLayer.from_plan(cc.plan, cap.input_names)
            try:  # first call: builds / loads the C++ kernel
                with torch.no_grad():
                    emb = layer(pytree.tree_leaves(cap.example_args))
            except (RuntimeError, OSError, ImportError) as e:  # no C++ toolchain, ...
                kernel_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
        if cc is None or cc.plan is None or kernel_error is not None:
            why = "fuse_columns=False" if cc is None else (
                "no embedding columns found" if not cc.columns.columns else
                "no column could be fused" if cc.plan is None else f"the fused kernel is unavailable ({kernel_error})")
            if cc is not None:
                warnings.warn(f"recforge.recom: {why}; the model is compiled as captured, without a fused "
                              "embedding layer", stacklevel=2)
            metadata["recom"] = cc.report if cc is not None else {"columns": None}
            metadata["recom_status"] = why
            metadata["column_compile_s"] = round(time.perf_counter() - t0, 3)
            compiled = CompiledModel(ep, backend=backend, metadata=metadata, warmup_inputs=inputs,
                                     in_spec=cap.in_spec, input_names=cap.input_names, fallback=module)
        else:
            leaves = pytree.tree_leaves(cap.example_args)
            gm, dense_names = build_residual(ep, cc.fused_out, cc.plan.total_dim)
            pos = {n: i for i, n in enumerate(cap.input_names)}
            dense_index = [pos[n] for n in dense_names]
            res_dims = _residual_dims(cap, dense_names) if dynamic_batch or dims is not None else \
                [None] * (len(dense_names) + 1)
            dense_ep = export_residual(gm, [leaves[i] for i in dense_index] + [emb], res_dims)
            metadata["recom"] = cc.report
            metadata["recom_status"] = f"{cc.report['fused']} of {cc.report['columns']} columns fused"
            metadata["column_compile_s"] = round(time.perf_counter() - t0, 3)
            compiled = CompiledModel(dense_ep, backend=backend, metadata=metadata, warmup_inputs=inputs,
                                     layer=layer, in_spec=cap.in_spec, dense_index=dense_index,
                                     input_names=cap.input_names, out_spec=ep.call_spec.out_spec,
                                     fallback=module, onednn=onednn)
        compiled.metadata["ops_compiled"] = sum(dispatched_ops(compiled, inputs).values())
        compiled.metadata["example_max_abs_diff"] = check_against_eager(compiled, module, inputs, atol=atol)
        if dims is not None and dynamic_shapes is None:  # the module's own dims: it cuts its rows (list columns)
            one = getattr(target, "rows_of")(inputs, [0])  # noqa: B009  (nn.Module's __getattr__ types)
        else:
            one = _first_row(inputs) if dynamic_batch and dynamic_shapes is None else None
        if one is not None:  # the capture reasoned about sizes >= 2: check the size it did not see
            try:
                with torch.no_grad():
                    module(*one)
            except Exception:  # noqa: BLE001  (the model itself refuses one row: nothing to compare)
                one = None
        if one is not None:
            compiled.metadata["one_row_max_abs_diff"] = check_against_eager(compiled, module, one, atol=atol)
    return compiled


def _aliases(target: nn.Module, input_names: list[str]) -> dict[str, Any]:
    """{"input_aliases": [...]} when the module names its flat inputs (InferenceModule.raw_input_names) and they
    differ from the captured placeholder names (a jagged dict's leaves are "jagged_<key>"): what serving accepts."""
    names = getattr(target, "raw_input_names", None)
    aliases = list(names()) if callable(names) else None
    if aliases is None or len(aliases) != len(input_names) or aliases == list(input_names):
        return {}
    return {"input_aliases": aliases}


def _first_row(inputs: tuple) -> tuple | None:
    """``inputs`` cut to their first row when every tensor leaf is batch-major (dim 0 = one batch size of at
    least 2), else None (jagged inputs cannot be cut by position)."""
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0]
    sizes = {int(t.shape[0]) for t in leaves}
    if len(sizes) != 1 or sizes.pop() < 2:
        return None
    return pytree.tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, inputs)


def _lifted_args(ep: torch.export.ExportedProgram, user_leaves: list[Any]) -> list[Any]:
    """The arguments of ``ep.graph_module`` (state lifted to inputs) for these flat user inputs: running it
    so costs nothing to set up, where ``ep.module()`` unlifts every table (seconds at a thousand columns)."""
    state = {**ep.state_dict, **(getattr(ep, "constants", None) or {})}
    leaves = iter(user_leaves)
    return [next(leaves) if s.kind == InputKind.USER_INPUT else state[s.target]
            for s in ep.graph_signature.input_specs]


def _residual_dims(cap, dense_names: list[str]) -> list[Any]:
    """The Dims of the residual program's inputs: the captured symbols, shared the same way; the fused
    output has the batch Dim."""
    dims: dict[str, Any] = {}

    def dim_for(symbol: str | None):
        if symbol is None:
            return None
        if symbol not in dims:
            is_batch = symbol == cap.batch_symbol
            dims[symbol] = torch.export.Dim("batch" if is_batch else f"len_{len(dims)}", min=1 if is_batch else 0)
        return dims[symbol]

    out = [dim_for(cap.dynamic_dims.get(n)) for n in dense_names]
    out.append(dim_for(cap.batch_symbol))
    return out


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b|; NaN where exactly one side is NaN counts as infinite, NaN on both sides as equal."""
    if a.shape != b.shape:
        raise CompileMismatchError(f"output shapes differ: compiled {tuple(a.shape)} vs eager {tuple(b.shape)}")
    a, b = a.detach().double(), b.detach().double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, torch.zeros_like(a), (a - b).abs())
    diff = torch.nan_to_num(diff, nan=float("inf"))
    return float(diff.max()) if diff.numel() else 0.0


def check_against_eager(compiled: Callable[..., torch.Tensor], eager: Callable[..., torch.Tensor],
                        inputs: Sequence[Any], atol: float = 1e-5) -> float:
    """Run both on ``inputs``; return the max abs diff, raise CompileMismatchError above ``atol``."""
    with torch.no_grad():
        got = compiled(*inputs)
        want = eager(*inputs)
    diff = max_abs_diff(got, want)
    if not diff <= atol:
        raise CompileMismatchError(
            f"compiled model differs from eager by {diff:.3g} (> atol {atol:g}) "
            f"on a batch of {batch_size_of(tuple(inputs))} rows"
        )
    return diff


def save(compiled: CompiledModel, path: str | os.PathLike) -> Path:
    """Write the compiled model to one file at ``path`` (temp file + rename)."""
    return save_compiled(compiled, path)


def load(path: str | os.PathLike, backend: Backend | None = None) -> CompiledModel:
    """Load a model written by ``save``; ``backend`` defaults to the one requested at compile time
    (Inductor / AOTInductor compile again here: pass ``backend="export"`` for an instant load)."""
    return load_compiled(path, backend)
