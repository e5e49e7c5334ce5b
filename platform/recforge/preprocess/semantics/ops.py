"""Vectorized torch implementations of the preprocessing ops (RAP / TorchArrow semantics).

Every op works on whole tensors ([B], [B, F] or [B, F, w]) with no per-row Python and no data-dependent control
flow, so it traces under torch.export; `*_jagged` take a list column as values[N] + lengths[B] (these have
data-dependent output sizes: eager only). `reference.py` holds the obvious numpy versions these are tested
against; registry.py documents each op's semantics.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

import recforge_kernels  # noqa: F401  (registers torch.ops.recforge.*)
from recforge_kernels.sigrid_hash import sigrid_hash_raw

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def fill_null(x: Tensor, valid: Tensor, value: float = 0, kind: Literal["dense", "sparse"] = "dense") -> Tensor:
    """Nulls (valid False) -> value; a dense column becomes float32, a sparse one int64."""
    if kind == "dense":
        return x.to(torch.float32).masked_fill(~valid, float(value))
    if kind != "sparse":
        raise ValueError(f"fill_null: kind must be 'dense' or 'sparse', got {kind!r}")
    if not float(value).is_integer():
        raise ValueError(f"fill_null: the fill value of a sparse (id) column must be an integer, got {value}")
    return x.to(torch.int64).masked_fill(~valid, int(value))


def cast(x: Tensor, to: Literal["float", "id"]) -> Tensor:
    """To float32 (round to nearest), or to int64: truncate toward zero, NaN -> 0, beyond int64 saturates."""
    if to == "float":
        return x.to(torch.float32)
    if to != "id":
        raise ValueError(f"cast: to must be 'float' or 'id', got {to!r}")
    if not x.is_floating_point():
        return x.to(torch.int64)
    big = x >= 2.0**63  # float32 holds 2**63 exactly; every smaller float32 fits int64
    small = x < -(2.0**63)
    safe = torch.where(big | small | torch.isnan(x), torch.zeros_like(x), x)
    y = torch.trunc(safe).to(torch.int64)
    y = torch.where(big, torch.full_like(y, INT64_MAX), y)
    return torch.where(small, torch.full_like(y, INT64_MIN), y)


def logit_bounds(eps: float) -> tuple[float, float]:
    """The float32 clamp bounds of logit(eps): eps and 1 - eps, each rounded from double once."""
    return float(torch.tensor(eps, dtype=torch.float32)), float(torch.tensor(1.0 - eps, dtype=torch.float32))


def logit(x: Tensor, eps: float | tuple[Tensor, Tensor] = 1e-5) -> Tensor:
    """t = clamp(x, eps, 1 - eps) in float32; ln(t / (1 - t)) evaluated in float64, rounded to float32 (float32
    arithmetic would leave results near 0 to the last bits of each library's log). NaN stays NaN."""
    if isinstance(eps, tuple):
        t = torch.minimum(torch.maximum(x, eps[0]), eps[1])
    else:
        t = torch.clamp(x, eps, 1.0 - eps)
    t64 = t.to(torch.float64)
    return torch.log(t64 / (1.0 - t64)).to(torch.float32)


def log1p(x: Tensor) -> Tensor:
    """log1p(max(x, 0)) evaluated in float64, rounded to float32 (counts: a negative count clamps to 0); NaN stays
    NaN."""
    return torch.log1p(torch.clamp(x.to(torch.float64), min=0.0)).to(torch.float32)


def boxcox(x: Tensor, lmbda: float | Tensor) -> Tensor:
    """x > 0: ln x when lambda == 0, else (x^lambda - 1) / lambda, evaluated in float64 and rounded to float32 (in
    float32, x^lambda - 1 cancels: with lambda = 1e-5 one ulp of pow is 1e-3 of the result); x <= 0 and NaN
    unchanged."""
    pos = x > 0
    safe = torch.where(pos, x, torch.ones_like(x)).to(torch.float64)  # keep the unused branch finite
    if isinstance(lmbda, Tensor):
        lam64 = lmbda.to(torch.float32).to(torch.float64)
        zero = lam64 == 0
        lam = torch.where(zero, torch.ones_like(lam64), lam64)
        y = torch.where(zero, torch.log(safe), (torch.pow(safe, lam) - 1.0) / lam)
    else:
        lam_f = float(torch.tensor(lmbda, dtype=torch.float32))  # lambda is a float32 parameter
        y = torch.log(safe) if lam_f == 0 else (torch.pow(safe, lam_f) - 1.0) / lam_f
    return torch.where(pos, y.to(torch.float32), x)


def bucketize(x: Tensor, borders: Sequence[float] | Tensor) -> Tensor:
    """y = #{i : x > borders[i]} as int64 (borders compared in x's dtype; NaN -> 0)."""
    b = borders if isinstance(borders, Tensor) else torch.tensor(list(borders), dtype=x.dtype, device=x.device)
    return (x.unsqueeze(-1) > b.to(x.dtype)).sum(dim=-1, dtype=torch.int64)


def clamp(x: Tensor, lo: float | Tensor, hi: float | Tensor) -> Tensor:
    """min(max(x, lo), hi); NaN stays NaN. ``lo`` and ``hi``: both tensors (broadcast) or both numbers."""
    if isinstance(lo, Tensor) and isinstance(hi, Tensor):
        return torch.minimum(torch.maximum(x, lo), hi)
    if isinstance(lo, Tensor) or isinstance(hi, Tensor):
        raise TypeError(f"clamp: lo and hi must both be tensors or both numbers, got {type(lo).__name__} "
                        f"and {type(hi).__name__}")
    return torch.clamp(x, lo, hi)


def firstx(x: Tensor, X: int) -> Tensor:
    """Keep the first X values of each row of a fixed-width list column: [..., w] -> [..., min(X, w)]."""
    if X < 1:
        raise ValueError(f"firstx: X must be >= 1, got {X}")
    return x[..., :X]


def sigrid_hash(x: Tensor, salt: int, M: int | Tensor) -> Tensor:
    """TorchArrow sigrid_hash via the `recforge` custom ops: one modulus (int), or one per column (int64[F])."""
    if isinstance(M, Tensor):
        return torch.ops.recforge.sigrid_hash_multi(x, salt, M)
    return torch.ops.recforge.sigrid_hash(x, salt, M)


def sigrid_hash_inline(x: Tensor, salt: int, M: int | Tensor) -> Tensor:
    """The same values as `sigrid_hash`, in plain torch ops (so torch.compile can fuse them); M >= 1."""
    h = sigrid_hash_raw(x, salt)
    return torch.remainder(h, M)


def onehot(x: Tensor, lo: float | Tensor, hi: float | Tensor, C: int) -> Tensor:
    """[..., 1] -> [..., C] float32: 1 at i = trunc((x - lo) / ((hi - lo) / C)) (float32 arithmetic), i = 0 when it
    is outside [0, C) (NaN and +-inf too)."""
    if x.shape[-1] != 1:
        raise ValueError(f"onehot: takes one value per row, got {x.shape[-1]}")
    xf = x.to(torch.float32)
    lo32 = lo.to(torch.float32) if isinstance(lo, Tensor) else torch.tensor(lo, dtype=torch.float32)
    hi32 = hi.to(torch.float32) if isinstance(hi, Tensor) else torch.tensor(hi, dtype=torch.float32)
    step = (hi32 - lo32) / float(C)
    q = (xf - lo32.to(xf.device)) / step.to(xf.device)
    inside = (q >= 0) & (q < C)
    idx = torch.where(inside, q, torch.zeros_like(q)).to(torch.int64)
    classes = torch.arange(C, device=x.device)
    return (idx == classes).to(torch.float32)


def ngram_index(w: int, n: int) -> Tensor:
    """Source positions of ngram(n) over a row of w values: every window of min(n, w) values, concatenated."""
    k = min(n, w)
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    return (torch.arange(w - k + 1)[:, None] + torch.arange(k)[None, :]).reshape(-1)


def ngram(x: Tensor, n: int) -> Tensor:
    """[..., w] -> [..., (w - n' + 1) * n'], n' = min(n, w)."""
    if n < 1:
        raise ValueError(f"ngram: n must be >= 1, got {n}")
    return x.index_select(-1, ngram_index(x.shape[-1], n).to(x.device))


def mapid(x: Tensor, table: Sequence[int] | Tensor) -> Tensor:
    """map[x] for 0 <= x < len(map), else 0 (int64)."""
    t = table if isinstance(table, Tensor) else torch.tensor(list(table), dtype=torch.int64, device=x.device)
    inside = (x >= 0) & (x < t.numel())
    return torch.where(inside, t[torch.where(inside, x, torch.zeros_like(x))], torch.zeros_like(x))


# ---------------------------------------------------------------- list (jagged) columns


def _row_positions(lengths: Tensor) -> tuple[Tensor, Tensor]:
    """For values[N] of rows with `lengths`: each value's row and its position inside the row."""
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return rows, torch.arange(rows.numel(), device=lengths.device) - starts[rows]


def firstx_jagged(values: Tensor, lengths: Tensor, X: int) -> tuple[Tensor, Tensor]:
    if X < 1:
        raise ValueError(f"firstx: X must be >= 1, got {X}")
    _, pos = _row_positions(lengths)
    return values[pos < X], torch.clamp(lengths, max=X)


def ngram_jagged(values: Tensor, lengths: Tensor, n: int) -> tuple[Tensor, Tensor]:
    if n < 1:
        raise ValueError(f"ngram: n must be >= 1, got {n}")
    k = torch.clamp(lengths, max=n)
    out_lengths = (lengths - k + 1) * k
    rows, pos = _row_positions(out_lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    k_row = k[rows]
    src = starts[rows] + pos // k_row.clamp(min=1) + pos % k_row.clamp(min=1)
    return values[src], out_lengths
