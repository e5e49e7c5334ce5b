"""The compile seam: ``compile(module, example_inputs) -> CompiledModel``, a torch.nn.Module matching eager.

This first form of RECom's compile stage:

1. lowers an ``InferenceModule`` to its gather form (one-hot lookups become plain gathers, proven from
   the preprocessing plan), which needs no KeyedJaggedTensor;
2. captures it with ``torch.export`` with one dynamic batch dimension shared by all inputs;
3. runs the exported graph with a backend: ``"export"`` (the exported graph module as is),
   ``"inductor"`` (``torch.compile`` of that module), ``"aoti"`` (AOTInductor ahead-of-time C++) or
   ``"auto"`` (the default: AOTInductor, else the exported graph);
4. checks the result against the eager module on the example inputs.

``save``/``load`` store the exported program (``torch.export.save``, a .pt2 file, temp + rename);
a loaded program is recompiled with the requested backend. Later issues replace step 1 with the full
column compiler (column identification, symbolic shapes, a fused embedding kernel) behind the same seam.
"""
from __future__ import annotations

import json
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

from recforge.recom.errors import CompileMismatchError
from recforge.recom.graph_stats import count_lookups, dispatched_ops, graph_ops

Backend = Literal["auto", "export", "inductor", "aoti"]
BACKENDS: tuple[str, ...] = ("auto", "export", "inductor", "aoti")
# bench/bench_compile.py (criteo_kaggle, 26 tables, 1 thread, CPU): AOTInductor is the fastest correct backend
# at B = 1, 64 and 1024 (about 6.5x, 4x and 2.5-3x the torchrec eager path; torch.compile 2.7x, 2.4x, 1.7x; the
# plain exported graph 1.4x, 1.35x, noisy at 1024). "auto" = AOTInductor, falling back to the plain exported
# graph (with a warning and the reason in metadata["backend_fallback"]) where it cannot build (no C++ toolchain).
DEFAULT_BACKEND: Backend = "auto"
_META_FILE = "recom_metadata.json"


def batch_size_of(inputs: Sequence[Any]) -> int:
    sizes = {t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"example_inputs must be tensors sharing one batch size (dim 0); got sizes {sorted(sizes)}")
    return sizes.pop()


def tile_rows(inputs: Sequence[Any], n: int) -> tuple:
    """Repeat rows cyclically to exactly ``n`` rows (export needs a batch >= 2 to keep it symbolic)."""
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
    """An exported (and optionally Inductor-compiled) model; ``forward`` takes the example inputs' layout.

    ``backend`` is the one running ("export", "inductor" or "aoti"); ``metadata``: requested_backend,
    backend, backend_fallback (why "auto" did not get AOTInductor, if it did not), dynamic_batch,
    example_batch, num_columns / num_tables, ``ops_before`` (ATen ops one eager forward of the source module
    dispatches), ``ops_after`` (ops one forward of the exported graph dispatches), ``graph_nodes``
    (call_function nodes in the exported graph), ``lookups_before`` / ``num_embedding_lookups`` (embedding
    ops before / in the exported graph), ``op_histogram``, ``export_s``, ``backend_compile_s``,
    ``example_max_abs_diff``.
    """

    def __init__(self, exported_program: torch.export.ExportedProgram, backend: str = DEFAULT_BACKEND,
                 metadata: dict[str, Any] | None = None, warmup_inputs: Sequence[Any] | None = None):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend: unknown {backend!r}; choose one of {list(BACKENDS)}")
        self.exported_program = exported_program
        self.graph_module = exported_program.module()
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.metadata.pop("backend_fallback", None)
        self.metadata["requested_backend"] = backend
        dynamic = bool(self.metadata.get("dynamic_batch", True))
        t0 = time.perf_counter()
        if backend == "auto":
            try:
                runner, keepalive = _make_runner(exported_program, self.graph_module, "aoti", dynamic)
                backend = "aoti"
            except Exception as e:  # no toolchain, unsupported op, ...: the exported graph still runs
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
                warnings.warn(f"recforge.recom: AOTInductor failed ({reason}); running the exported graph",
                              stacklevel=2)
                self.metadata["backend_fallback"] = reason
                runner, keepalive, backend = self.graph_module, None, "export"
        else:
            runner, keepalive = _make_runner(exported_program, self.graph_module, backend, dynamic)
        self.backend = backend
        self.metadata["backend"] = backend
        # Not registered as submodules: they wrap graph_module (or are not Modules at all).
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_keepalive", keepalive)
        if warmup_inputs is not None and backend == "inductor":
            self(*warmup_inputs)  # pay torch.compile's compile here, in the compile stage
            if dynamic:  # Dynamo specializes size-1 dims: compile the B=1 variant now, not on the first request
                self(*tile_rows(tuple(warmup_inputs), 1))
        self.metadata["backend_compile_s"] = round(time.perf_counter() - t0, 3)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._runner(*inputs)

    def save(self, path: str | os.PathLike) -> Path:
        return save(self, path)


def _describe(module: nn.Module) -> dict[str, int]:
    cols = getattr(module, "columns", None)
    if not cols:
        return {}
    return {"num_columns": len(cols), "num_tables": len({c.table for c in cols})}


def compile(module: nn.Module, example_inputs: Sequence[Any], dynamic_batch: bool = True,
            backend: Backend = DEFAULT_BACKEND, atol: float = 1e-5) -> CompiledModel:
    """Compile ``module`` (an InferenceModule is first lowered to its gather form) for inference.

    The result is checked against ``module`` on ``example_inputs`` (CompileMismatchError above ``atol``).
    Raises NotOneHotError when an InferenceModule's one-id-per-row cannot be proven.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; choose one of {list(BACKENDS)}")
    inputs = tuple(example_inputs)
    target = module.lowered() if hasattr(module, "lowered") else module
    with eval_mode(module):
        before = dispatched_ops(module, inputs)
        t0 = time.perf_counter()
        ep = export_program(target, inputs, dynamic_batch=dynamic_batch)
        export_s = time.perf_counter() - t0
        nodes = graph_ops(ep.graph_module)
        after = dispatched_ops(ep.module(), inputs)
        metadata = {
            "dynamic_batch": dynamic_batch,
            "example_batch": batch_size_of(inputs),
            **_describe(target),
            "ops_before": sum(before.values()),
            "ops_after": sum(after.values()),
            "graph_nodes": sum(nodes.values()),
            "lookups_before": count_lookups(before),
            "num_embedding_lookups": count_lookups(nodes),
            "op_histogram": dict(sorted(nodes.items())),
            "export_s": round(export_s, 3),
        }
        compiled = CompiledModel(ep, backend=backend, metadata=metadata, warmup_inputs=inputs)
        compiled.metadata["example_max_abs_diff"] = check_against_eager(compiled, module, inputs, atol=atol)
    return compiled


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
    """Write the exported program (+ metadata) to ``path`` (.pt2) through a temp file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        meta = {k: v for k, v in compiled.metadata.items()}
        torch.export.save(compiled.exported_program, tmp, extra_files={_META_FILE: json.dumps(meta)})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _register_custom_ops() -> None:
    """Exported graphs may call recforge's torch.library ops: make sure they are registered before loading."""
    try:
        import recforge_kernels  # noqa: F401
    except ImportError:
        pass


def load(path: str | os.PathLike, backend: Backend | None = None) -> CompiledModel:
    """Load a program written by ``save``; ``backend`` defaults to the one requested at compile time
    (Inductor / AOTInductor compile again here: pass ``backend="export"`` for an instant load)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"compiled model not found: {path}")
    _register_custom_ops()
    extra = {_META_FILE: ""}
    ep = torch.export.load(path, extra_files=extra)
    meta = json.loads(extra[_META_FILE]) if extra[_META_FILE] else {}
    return CompiledModel(ep, backend=backend or meta.get("requested_backend", DEFAULT_BACKEND), metadata=meta)
