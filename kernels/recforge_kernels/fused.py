"""Horizontally fused preprocessing ops: `recforge::fused_<op>`, one call per fused group (RAP §3.2).

Each op takes one tensor per feature of the group (Tensor[]) and per-feature parameters as lists, and returns
one tensor per feature. They are torch custom ops (torch.library), so torch.compile and torch.export see them:
* CPU: the C++ kernels of csrc/fused_cpu.cpp (built on first use, cpu_ext.py), else the torch fallback
  (fused_torch.py) with the same values;
* CUDA: Triton kernels (triton_fused.py) with the feature index as the first program axis, registered when
  triton is importable;
* fake (meta) implementations give shapes for tracing; the jagged ops have data-dependent sizes.
`recforge::fused_chain` is the CPU single-pass form: every feature's whole chain per row tile, one call per batch
(recforge.preprocess.executors.chain builds its program; C++ only).
Semantics of every op: recforge.preprocess.semantics.registry.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from recforge_kernels import cpu_ext
from recforge_kernels import fused_torch as fallback

_CPU_BACKEND = {"name": "cpp"}


def set_cpu_backend(name: str) -> None:
    """"cpp" (default: the C++ kernels when they build) or "torch" (the fallback), e.g. to measure one against the
    other in a benchmark."""
    if name not in ("cpp", "torch"):
        raise ValueError(f"set_cpu_backend: 'cpp' or 'torch', got {name!r}")
    _CPU_BACKEND["name"] = name


def use_cpp() -> bool:
    return _CPU_BACKEND["name"] == "cpp" and cpu_ext.load()


def _cpu(name: str) -> Callable:
    """The C++ kernel when the extension loads, else the torch fallback."""
    if use_cpp():
        return getattr(torch.ops.recforge_cpu, name)
    return getattr(fallback, name)


@torch.library.custom_op("recforge::fused_fill_null_columns", mutates_args=())
def fused_fill_null_columns(x: Tensor, valid: Tensor, cols: list[int], values: list[float],
                            dense: bool) -> list[Tensor]:
    """Columns `cols` of raw x[B, F] (int64) with nulls (valid False) set to values[f]: float32 (dense) / int64."""
    if x.device.type == "cpu":
        return list(_cpu("fill_null_columns")(x, valid, cols, values, dense))
    if x.device.type == "cuda" and (cuda := _cuda("fill_null_columns")) is not None:
        return cuda(x, valid, cols, values, dense)
    return fallback.fill_null_columns(x, valid, cols, values, dense)


@fused_fill_null_columns.register_fake
def _(x, valid, cols, values, dense):
    return [x.new_empty((x.shape[0],), dtype=torch.float32 if dense else torch.int64) for _ in cols]


@torch.library.custom_op("recforge::fused_fill_null", mutates_args=())
def fused_fill_null(xs: list[Tensor], valids: list[Tensor], values: list[float], dense: bool) -> list[Tensor]:
    """Values of list columns (int64, any shape) with null elements set to values[f]."""
    if xs and xs[0].device.type == "cpu":
        return list(_cpu("fill_null")(xs, valids, values, dense))
    if xs and xs[0].device.type == "cuda" and (cuda := _cuda("fill_null")) is not None:
        return cuda(xs, valids, values, dense)
    return fallback.fill_null(xs, valids, values, dense)


@fused_fill_null.register_fake
def _(xs, valids, values, dense):
    return [torch.empty_like(x, dtype=torch.float32 if dense else torch.int64) for x in xs]


def _elementwise(name: str, out_dtype: torch.dtype | None, doc: str):
    """Define recforge::fused_<name>(xs, *params) for an op whose output has its input's shape."""

    def register(fn):
        op = torch.library.custom_op(f"recforge::fused_{name}", mutates_args=())(fn)

        @op.register_fake
        def _(xs, *args):
            return [torch.empty_like(x, dtype=out_dtype or x.dtype) for x in xs]

        op.__doc__ = doc
        return op

    return register


def _dispatch(name: str, xs: list[Tensor], *args):
    if xs and xs[0].device.type == "cpu":
        return list(_cpu(name)(xs, *args))
    cuda = _cuda(name) if xs and xs[0].device.type == "cuda" else None
    if cuda is not None:
        return cuda(xs, *args)
    return getattr(fallback, name)(xs, *args)


@_elementwise("cast_float", torch.float32, "int64 -> float32 (round to nearest)")
def fused_cast_float(xs: list[Tensor]) -> list[Tensor]:
    return _dispatch("cast", xs, True)


@_elementwise("cast_id", torch.int64, "float32 -> int64: truncate, NaN -> 0, saturate beyond int64")
def fused_cast_id(xs: list[Tensor]) -> list[Tensor]:
    return _dispatch("cast", xs, False)


@_elementwise("clamp_float", torch.float32, "min(max(x, lo[f]), hi[f]) on float32; NaN stays NaN")
def fused_clamp_float(xs: list[Tensor], lo: list[float], hi: list[float]) -> list[Tensor]:
    return _dispatch("clamp_float", xs, lo, hi)


@_elementwise("clamp_id", torch.int64, "min(max(x, lo[f]), hi[f]) on int64")
def fused_clamp_id(xs: list[Tensor], lo: list[int], hi: list[int]) -> list[Tensor]:
    return _dispatch("clamp_id", xs, lo, hi)


@_elementwise("bucketize", torch.int64, "#{k: x > borders[offsets[f] + k]}; NaN -> 0")
def fused_bucketize(xs: list[Tensor], borders: Tensor, offsets: list[int]) -> list[Tensor]:
    return _dispatch("bucketize", xs, borders, offsets)


@_elementwise("mapid", torch.int64, "table[offsets[f] + x] for 0 <= x < its length, else 0")
def fused_mapid(xs: list[Tensor], table: Tensor, offsets: list[int]) -> list[Tensor]:
    return _dispatch("mapid", xs, table, offsets)


@_elementwise("sigrid_hash", torch.int64, "TorchArrow sigrid_hash(x, salts[f]) floor-mod moduli[f]")
def fused_sigrid_hash(xs: list[Tensor], salts: list[int], moduli: list[int]) -> list[Tensor]:
    return _dispatch("sigrid_hash", xs, salts, moduli)


@_elementwise("logit", torch.float32, "t = clamp(x, lo[f], hi[f]); ln(t / (1 - t)) in float64 -> float32")
def fused_logit(xs: list[Tensor], lo: list[float], hi: list[float]) -> list[Tensor]:
    return _dispatch("logit", xs, lo, hi)


@_elementwise("log1p", torch.float32, "log1p(max(x, 0)) in float64 -> float32; NaN stays NaN")
def fused_log1p(xs: list[Tensor]) -> list[Tensor]:
    return _dispatch("log1p", xs)


@_elementwise("boxcox", torch.float32, "x > 0: boxcox(x, lambdas[f]) in float64 -> float32; else x")
def fused_boxcox(xs: list[Tensor], lambdas: list[float]) -> list[Tensor]:
    return _dispatch("boxcox", xs, lambdas)


@torch.library.custom_op("recforge::fused_onehot", mutates_args=())
def fused_onehot(xs: list[Tensor], lo: list[float], hi: list[float], classes: list[int],
                 keep: list[int]) -> list[Tensor]:
    """One value per row ([B] or [B, 1]) -> float32 [B, min(classes[f], keep[f])]: the first columns of the
    one-hot rows (keep < classes when no consumer reads the others)."""
    return _dispatch("onehot", xs, lo, hi, classes, keep)


@fused_onehot.register_fake
def _(xs, lo, hi, classes, keep):
    return [x.new_empty((x.shape[0], min(c, k)), dtype=torch.float32)
            for x, c, k in zip(xs, classes, keep, strict=True)]


@torch.library.custom_op("recforge::fused_firstx", mutates_args=())
def fused_firstx(xs: list[Tensor], X: list[int]) -> list[Tensor]:
    """[B, w] -> [B, min(X[f], w)]."""
    return _dispatch("firstx", xs, X)


@fused_firstx.register_fake
def _(xs, X):
    return [x.new_empty((x.shape[0], min(k, x.shape[1]))) for x, k in zip(xs, X, strict=True)]


@torch.library.custom_op("recforge::fused_ngram", mutates_args=())
def fused_ngram(xs: list[Tensor], n: list[int]) -> list[Tensor]:
    """[B, w] -> [B, (w - k + 1) * k], k = min(n[f], w): every window of k values, concatenated."""
    return _dispatch("ngram", xs, n)


@fused_ngram.register_fake
def _(xs, n):
    out = []
    for x, m in zip(xs, n, strict=True):
        w = x.shape[1]
        k = min(m, w)
        out.append(x.new_empty((x.shape[0], (w - k + 1) * k)))
    return out


def _jagged_fake(values, lengths):
    ctx = torch.library.get_ctx()
    return [v.new_empty((ctx.new_dynamic_size(),)) for v in values] + [torch.empty_like(ln) for ln in lengths]


@torch.library.custom_op("recforge::fused_firstx_jagged", mutates_args=())
def fused_firstx_jagged(values: list[Tensor], lengths: list[Tensor], X: list[int]) -> list[Tensor]:
    """List columns (values + int64 lengths) -> the first X[f] values of each row: new values..., new lengths..."""
    if values and values[0].device.type == "cpu":
        return list(_cpu("firstx_jagged")(values, lengths, X))
    return fallback.firstx_jagged(values, lengths, X)


@fused_firstx_jagged.register_fake
def _(values, lengths, X):
    return _jagged_fake(values, lengths)


@torch.library.custom_op("recforge::fused_ngram_jagged", mutates_args=())
def fused_ngram_jagged(values: list[Tensor], lengths: list[Tensor], n: list[int]) -> list[Tensor]:
    """List columns -> ngram(n[f]) of each row: new values..., new lengths..."""
    if values and values[0].device.type == "cpu":
        return list(_cpu("ngram_jagged")(values, lengths, n))
    return fallback.ngram_jagged(values, lengths, n)


@fused_ngram_jagged.register_fake
def _(values, lengths, n):
    return _jagged_fake(values, lengths)


@torch.library.custom_op("recforge::stack_columns", mutates_args=())
def stack_columns(cols: list[Tensor]) -> Tensor:
    """Columns (B values each, any stride: [B] or [B, 1] views, one dtype) -> a row-major [B, F] matrix."""
    if cols and cols[0].device.type == "cpu" and cols[0].element_size() in (4, 8) and use_cpp():
        return torch.ops.recforge_cpu.stack_columns(cols)
    return torch.stack([c.reshape(-1) for c in cols], dim=1)


@stack_columns.register_fake
def _(cols):
    return cols[0].new_empty((cols[0].shape[0], len(cols)))


@torch.library.custom_op("recforge::fused_chain", mutates_args=())
def fused_chain(dense_raw: Tensor, dense_valid: Tensor, sparse_raw: Tensor, sparse_valid: Tensor,
                src_kind: list[int], src_col: list[int], out_kind: list[int], out_slot: list[int],
                step_offsets: list[int], codes: list[int], f0: list[float], f1: list[float], i0: list[int],
                i1: list[int], borders: Tensor, table: Tensor, num_dense: int, num_sparse: int) -> list[Tensor]:
    """Every feature's whole op chain in one pass over row tiles (CPU, C++ only): [dense float32 [B, num_dense],
    ids int64 [num_sparse * B] key-major]. The program comes from recforge.preprocess.executors.chain."""
    if dense_raw.device.type != "cpu" or not use_cpp():
        raise NotImplementedError("recforge::fused_chain runs on CPU with the C++ kernels only "
                                  f"({cpu_ext.status()}); run the grouped recforge::fused_* ops instead")
    return list(torch.ops.recforge_cpu.chain(dense_raw, dense_valid, sparse_raw, sparse_valid, src_kind, src_col,
                                             out_kind, out_slot, step_offsets, codes, f0, f1, i0, i1, borders,
                                             table, num_dense, num_sparse))


@fused_chain.register_fake
def _(dense_raw, dense_valid, sparse_raw, sparse_valid, src_kind, src_col, out_kind, out_slot, step_offsets, codes,
      f0, f1, i0, i1, borders, table, num_dense, num_sparse):
    rows = dense_raw.shape[0]
    return [dense_raw.new_empty((rows, num_dense), dtype=torch.float32),
            dense_raw.new_empty((num_sparse * rows,), dtype=torch.int64)]


def eager_impl(op) -> Callable:
    """The Python body behind a recforge::fused_* op: same arguments and results, without the dispatcher and
    custom-op layers (tens of microseconds per call with many tensors). For eager callers on CPU; torch.compile /
    torch.export see the registered ops."""
    return getattr(op, "_init_fn", op)  # torch's CustomOpDef keeps the function it wraps here


# CUDA implementations by kernel name, from triton_fused, imported on the first CUDA call: importing triton costs
# every process ~150 ms, and CPU-only processes never need it.
_CUDA: dict[str, Callable] | None = None


def _cuda(name: str) -> Callable | None:
    """The Triton kernel `name`, or None (no triton here: CUDA tensors use the torch fallback)."""
    global _CUDA
    if _CUDA is None:
        try:
            from recforge_kernels import triton_fused  # lazy: triton is optional, imported on first CUDA call

            _CUDA = dict(triton_fused.KERNELS)
        except ImportError:
            _CUDA = {}
    return _CUDA.get(name)
