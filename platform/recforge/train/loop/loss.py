"""Weighted BCE with the normalization that makes padded, distributed steps exact.

Every rank holds a full batch (padding rows have weight 0). Rank r's loss is
    sum_i w_i * bce_i / W_global * world_size
where W_global is the sum of weights over all ranks. DDP averages dense gradients over ranks and
torchrec divides the embedding all-to-all gradients by world size, so the update equals the gradient
of the plain mean BCE over the real samples of the global step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def weighted_bce_sum(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * BCE(logit_i, label_i); logits may be [B] or [B, 1]."""
    logits = logits.reshape(-1)
    if logits.shape != labels.shape or labels.shape != weights.shape:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}, "
                         f"weights {tuple(weights.shape)}")
    per = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    return (per * weights.to(per.dtype)).sum()


def step_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, global_weight: float, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss to backpropagate on this rank, this rank's weighted BCE sum detached)."""
    if global_weight <= 0:
        raise ValueError(f"global_weight must be > 0, got {global_weight}")
    s = weighted_bce_sum(logits, labels, weights)
    return s * (world_size / global_weight), s.detach()
