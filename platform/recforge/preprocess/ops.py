"""Vectorized torch implementations of the preprocessing ops (RAP / TorchArrow semantics).

Every op works on whole tensors ([B] or [B, F]) with no per-row Python and no data-dependent control flow, so
it traces under torch.export. `reference.py` holds the obvious numpy versions these are tested against.
"""
from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor

import recforge_kernels  # registers torch.ops.recforge.*


def fill_null(x: Tensor, valid: Tensor, value: float = 0, kind: Literal["dense", "sparse"] = "dense") -> Tensor:
    """Nulls (valid False) -> value; a dense column becomes float32, a sparse one int64."""
    if kind == "dense":
        return x.to(torch.float32).masked_fill(~valid, float(value))
    if kind != "sparse":
        raise ValueError(f"fill_null: kind must be 'dense' or 'sparse', got {kind!r}")
    if not float(value).is_integer():
        raise ValueError(f"fill_null: the fill value of a sparse (id) column must be an integer, got {value}")
    return x.to(torch.int64).masked_fill(~valid, int(value))


def logit(x: Tensor, eps: float = 1e-5) -> Tensor:
    """t = clamp(x, eps, 1 - eps); ln(t / (1 - t)). NaN stays NaN."""
    t = torch.clamp(x, eps, 1.0 - eps)
    return torch.log(t / (1.0 - t))


def boxcox(x: Tensor, lmbda: float) -> Tensor:
    """x > 0: ln x when lambda == 0, else (x^lambda - 1) / lambda; x <= 0 (and NaN) unchanged."""
    pos = x > 0
    safe = torch.where(pos, x, torch.ones_like(x))  # keep the unused branch finite
    y = torch.log(safe) if lmbda == 0 else (torch.pow(safe, lmbda) - 1.0) / lmbda
    return torch.where(pos, y, x)


def bucketize(x: Tensor, borders: Sequence[float] | Tensor) -> Tensor:
    """y = #{i : x > borders[i]} as int64 (borders compared in x's dtype; NaN -> 0)."""
    b = borders if isinstance(borders, Tensor) else torch.tensor(list(borders), dtype=x.dtype, device=x.device)
    return (x.unsqueeze(-1) > b.to(x.dtype)).sum(dim=-1, dtype=torch.int64)


def clamp(x: Tensor, lo: float, hi: float) -> Tensor:
    """min(max(x, lo), hi); NaN stays NaN."""
    return torch.clamp(x, lo, hi)


def firstx(x: Tensor, X: int) -> Tensor:
    """Keep the first X values of each row of a fixed-width list column: [B, w] -> [B, min(X, w)]."""
    if X < 1:
        raise ValueError(f"firstx: X must be >= 1, got {X}")
    return x[:, :X]


def sigrid_hash(x: Tensor, salt: int, M: int | Tensor) -> Tensor:
    """TorchArrow sigrid_hash via the `recforge` custom ops: one modulus (int), or one per column (int64[F])."""
    if isinstance(M, Tensor):
        return torch.ops.recforge.sigrid_hash_multi(x, salt, M)
    return torch.ops.recforge.sigrid_hash(x, salt, M)
