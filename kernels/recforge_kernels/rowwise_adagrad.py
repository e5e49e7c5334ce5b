"""A faster CPU backward for FBGEMM's table-batched embedding bags trained with exact row-wise Adagrad.

FBGEMM's CPU backward for `SplitTableBatchedEmbeddingBagsCodegen` (EXACT_ROWWISE_ADAGRAD, host weights) radix-sorts
each table's lookups into a compressed-column layout, then runs JIT kernels per block of rows: ~370 ns per lookup
here, ~5 ms of a ~20 ms DLRM step on the 2-core machine (13 tables x 1,024 lookups per rank). csrc/
rowwise_adagrad_cpu.cpp finds each table's distinct rows with a small hash table, sums their gradients in lookup
order and applies the same update (m += mean(g^2); w -= lr * g / (sqrt(m) + eps)) in place, on the module's own
weights and momentum, so checkpoints, the fused optimizer's state and learning-rate changes are untouched
(bench/bench_rowwise_adagrad.py times both).

`install(tbe)` routes a module's training lookups through the kernels when `unsupported(tbe)` finds nothing against
it; a call with per-sample weights, variable batch sizes or other extras, or without autograd, keeps FBGEMM's own
forward. The forward is a plain sum of rows in bag order (FBGEMM's values); an id outside its table raises, naming the
feature, where FBGEMM's default bounds check would warn and read row 0.
"""
from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from recforge_kernels.op_library import OpLibrary

SOURCE = Path(__file__).parent / "csrc" / "rowwise_adagrad_cpu.cpp"
LIBRARY = OpLibrary("recforge_rowwise_adagrad", SOURCE, probe="backward_update")
INSTALLED = "_recforge_rowwise_adagrad"  # attribute set on a module whose lookups the kernels serve


def unsupported(tbe: Any) -> str | None:
    """Why the kernels cannot serve FBGEMM module `tbe` (None: they can)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType  # lazy: fbgemm only where it is used
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode  # lazy: as above

    if getattr(tbe, "optimizer", None) != EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        return f"optimizer {getattr(tbe, 'optimizer', None)} (only exact row-wise Adagrad)"
    host = getattr(tbe, "weights_host", None)
    if not isinstance(host, Tensor) or host.numel() == 0 or host.device.type != "cpu":
        return "weights are not on the host (CPU) in one tensor"
    if tbe.weights_precision != SparseType.FP32 or host.dtype != torch.float32 or tbe.output_dtype != 0:
        return f"weights {tbe.weights_precision}, output dtype {tbe.output_dtype} (only float32)"
    if tbe.pooling_mode != PoolingMode.SUM:
        return f"pooling {tbe.pooling_mode} (only sum)"
    if list(tbe.feature_table_map) != list(range(len(tbe.feature_table_map))):
        return "features share tables"
    args = tbe.optimizer_args
    if args.weight_decay != 0.0 or args.weight_decay_mode != 0 or args.gradient_clipping or args.max_norm != 0.0:
        return (f"weight decay {args.weight_decay} (mode {args.weight_decay_mode}), gradient clipping "
                f"{args.gradient_clipping}, max norm {args.max_norm} (none supported)")
    if getattr(tbe, "_used_rowwise_adagrad_with_counter", False) or getattr(
            tbe, "_used_rowwise_adagrad_with_global_weight_decay", False):
        return "row-wise Adagrad with counters or global weight decay (extra per-row state)"
    if tbe.momentum1_host.dtype != torch.float32:
        return f"momentum in {tbe.momentum1_host.dtype} (only float32)"
    if LIBRARY.ops() is None:
        return f"the C++ kernels are not available ({LIBRARY.status()})"
    return None


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, placeholder: Tensor, tbe: Any, indices: Tensor, offsets: Tensor, batch: int) -> Tensor:
        ctx.tbe = tbe
        ctx.save_for_backward(indices, offsets)
        return LIBRARY.loaded().forward(tbe.weights_host, tbe.weights_offsets, tbe.D_offsets, tbe.hash_size_cumsum,
                                     indices, offsets, batch)

    @staticmethod
    @once_differentiable  # the update is applied, not differentiated further
    def backward(ctx: Any, grad: Tensor) -> tuple[None, ...]:
        tbe = ctx.tbe
        indices, offsets = ctx.saved_tensors
        LIBRARY.loaded().backward_update(grad, tbe.weights_host, tbe.weights_offsets, tbe.D_offsets,
                                      tbe.hash_size_cumsum, indices, offsets, tbe.momentum1_host,
                                      tbe.momentum1_offsets, tbe.get_learning_rate(), tbe.optimizer_args.eps)
        return None, None, None, None, None


def lookup(tbe: Any, indices: Tensor, offsets: Tensor) -> Tensor:
    """The pooled [B, total_D] lookup of `tbe`; its backward updates the module's rows in place (as FBGEMM's)."""
    features = tbe.D_offsets.numel() - 1
    if (offsets.numel() - 1) % features:
        raise ValueError(f"rowwise_adagrad: {offsets.numel()} offsets for {features} features: not features x batch "
                         "+ 1")
    return _Lookup.apply(tbe.placeholder_autograd_tensor, tbe, indices.long(), offsets.long(),
                         (offsets.numel() - 1) // features)


def install(tbe: Any) -> bool:
    """Route `tbe`'s training lookups through the kernels (idempotent); False, changing nothing, when
    `unsupported(tbe)` names a reason."""
    if getattr(tbe, INSTALLED, False):
        return True
    if unsupported(tbe) is not None:
        return False
    stock = type(tbe).forward  # unbound: a copy of the module falls back to its own forward

    def forward(self: Any, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None,
                **extras: Any) -> Tensor:
        if (per_sample_weights is not None or any(v is not None for v in extras.values())
                or not torch.is_grad_enabled() or indices.device.type != "cpu"):
            return stock(self, indices, offsets, per_sample_weights, **extras)
        return lookup(self, indices, offsets)

    tbe.forward = types.MethodType(forward, tbe)
    setattr(tbe, INSTALLED, True)
    return True
