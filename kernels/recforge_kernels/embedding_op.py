"""``recforge::embedding_layer``: the whole embedding layer of a model as one torch custom op.

    embedding_layer(Tensor[] inputs, Tensor weights, Tensor fbuf, Tensor ibuf, Tensor meta, SymInt batch,
                    int total_dim) -> Tensor

Raw per-column inputs, all tables packed into one float32 buffer, the bucketize boundaries and one metadata row
per column (``embedding_layout``) in; the float32 [batch, total_dim] output out. Schema and fake function here;
kernels in ``embedding_cpu`` (C++) and ``embedding_triton`` (CUDA). Design: docs/recom.md#the-fused-embedding-op.
"""
from __future__ import annotations

import torch
from torch import Tensor

from recforge_kernels import embedding_layout as L

SCHEMA = ("embedding_layer(Tensor[] inputs, Tensor weights, Tensor fbuf, Tensor ibuf, Tensor meta, SymInt batch, "
          "int total_dim) -> Tensor")

_lib = torch.library.Library("recforge", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_lib.define(SCHEMA)


def _check(weights: Tensor, meta: Tensor) -> None:
    if meta.dim() != 2 or meta.shape[1] != L.META_WIDTH or meta.dtype != torch.int64:
        raise ValueError(f"embedding_layer: meta must be int64 [C, {L.META_WIDTH}], "
                         f"got {meta.dtype} {list(meta.shape)}")
    if weights.dtype != torch.float32 or weights.dim() != 1:
        raise ValueError(f"embedding_layer: weights must be a float32 vector, "
                         f"got {weights.dtype} {list(weights.shape)}")


@torch.library.register_fake("recforge::embedding_layer", lib=_lib)
def _fake(inputs, weights, fbuf, ibuf, meta, batch, total_dim):
    _check(weights, meta)
    return weights.new_empty((batch, total_dim))


def _load_then_call(inputs, weights, fbuf, ibuf, meta, batch, total_dim):
    """Runs until the C++ CPU kernel is registered (its extension builds on first use)."""
    if weights.device.type != "cpu":
        raise NotImplementedError(f"recforge::embedding_layer has no kernel for {weights.device.type} here "
                                  "(the CUDA kernel needs triton)")
    from recforge_kernels.embedding_cpu import module  # lazy: builds / loads C++ only when the CPU kernel runs

    _check(weights, meta)
    module()  # loading the extension registers the CPU kernel, which wins over this one from now on
    return torch.ops.recforge.embedding_layer.default(inputs, weights, fbuf, ibuf, meta, batch, total_dim)


_lib.impl("embedding_layer", _load_then_call, "CompositeExplicitAutograd")


def embedding_layer(inputs: list[Tensor], weights: Tensor, fbuf: Tensor, ibuf: Tensor, meta: Tensor,
                    batch: int, total_dim: int) -> Tensor:
    """torch.ops.recforge.embedding_layer with its arguments checked first."""
    _check(weights, meta)
    return torch.ops.recforge.embedding_layer.default(inputs, weights, fbuf, ibuf, meta, batch, total_dim)


def workspace_elements(inputs: list[Tensor], meta: Tensor, batch: int) -> int:
    """Elements of the one int64 workspace the CPU kernel lays out for these inputs."""
    from recforge_kernels.embedding_cpu import module  # lazy: builds / loads C++ only when the CPU kernel runs

    return int(module().workspace_elems(inputs, meta, batch))


def _register_cuda() -> bool:
    try:
        from recforge_kernels.embedding_triton import embedding_layer_cuda  # lazy: triton is optional
    except ImportError:  # no triton: the op has no CUDA kernel here
        return False
    _lib.impl("embedding_layer", embedding_layer_cuda, "CUDA")
    return True


HAS_CUDA_KERNEL = _register_cuda()
