"""Torch fallback of the fused kernels: the same values as csrc/fused_cpu.cpp, one feature at a time.

Used on CPU when the C++ extension cannot be built (no compiler, RECFORGE_NO_CPP=1) and by tests as a second
implementation. Semantics: recforge.preprocess.semantics.registry.
"""
from __future__ import annotations

import torch
from torch import Tensor

from recforge_kernels.sigrid_hash import sigrid_hash_raw

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def fill_null_columns(x: Tensor, valid: Tensor, cols: list[int], values: list[float], dense: bool) -> list[Tensor]:
    return fill_null([x[:, c] for c in cols], [valid[:, c] for c in cols], values, dense)


def fill_null(xs: list[Tensor], valids: list[Tensor], values: list[float], dense: bool) -> list[Tensor]:
    dtype = torch.float32 if dense else torch.int64
    out = []
    for x, v, fill in zip(xs, valids, values, strict=True):
        fill_t = torch.tensor(fill if dense else int(fill), dtype=dtype, device=x.device)
        out.append(torch.where(v, x.to(dtype), fill_t).contiguous())
    return out


def cast(xs: list[Tensor], to_float: bool) -> list[Tensor]:
    if to_float:
        return [x.to(torch.float32) for x in xs]
    out = []
    for x in xs:
        big, small = x >= 2.0**63, x < -(2.0**63)
        safe = torch.where(big | small | torch.isnan(x), torch.zeros_like(x), x)
        y = torch.trunc(safe).to(torch.int64)
        y = torch.where(big, torch.full_like(y, INT64_MAX), y)
        out.append(torch.where(small, torch.full_like(y, INT64_MIN), y))
    return out


def clamp_float(xs: list[Tensor], lo: list[float], hi: list[float]) -> list[Tensor]:
    return [torch.clamp(x, lo_f, hi_f) for x, lo_f, hi_f in zip(xs, lo, hi, strict=True)]


def clamp_id(xs: list[Tensor], lo: list[int], hi: list[int]) -> list[Tensor]:
    return [torch.clamp(x, int(lo_f), int(hi_f)) for x, lo_f, hi_f in zip(xs, lo, hi, strict=True)]


def bucketize(xs: list[Tensor], borders: Tensor, offsets: list[int]) -> list[Tensor]:
    b = borders.to(torch.float32)
    return [(x.unsqueeze(-1) > b[offsets[f]:offsets[f + 1]].to(x.device)).sum(-1, dtype=torch.int64)
            for f, x in enumerate(xs)]


def mapid(xs: list[Tensor], table: Tensor, offsets: list[int]) -> list[Tensor]:
    out = []
    for f, x in enumerate(xs):
        t = table[offsets[f]:offsets[f + 1]].to(device=x.device, dtype=torch.int64)
        if t.numel() == 0:
            out.append(torch.zeros_like(x))
            continue
        inside = (x >= 0) & (x < t.numel())
        out.append(torch.where(inside, t[torch.where(inside, x, torch.zeros_like(x))], torch.zeros_like(x)))
    return out


def sigrid_hash(xs: list[Tensor], salts: list[int], moduli: list[int]) -> list[Tensor]:
    return [torch.remainder(sigrid_hash_raw(x, s), m) for x, s, m in zip(xs, salts, moduli, strict=True)]


def logit(xs: list[Tensor], lo: list[float], hi: list[float]) -> list[Tensor]:
    out = []
    for x, lo_f, hi_f in zip(xs, lo, hi, strict=True):
        t = torch.clamp(x, lo_f, hi_f).to(torch.float64)
        out.append(torch.log(t / (1.0 - t)).to(torch.float32))
    return out


def log1p(xs: list[Tensor]) -> list[Tensor]:
    return [torch.log1p(torch.clamp(x.to(torch.float64), min=0.0)).to(torch.float32) for x in xs]


def boxcox(xs: list[Tensor], lambdas: list[float]) -> list[Tensor]:
    out = []
    for x, lam in zip(xs, lambdas, strict=True):
        lam = float(torch.tensor(lam, dtype=torch.float32))
        pos = x > 0
        safe = torch.where(pos, x, torch.ones_like(x)).to(torch.float64)
        y = torch.log(safe) if lam == 0 else (torch.pow(safe, lam) - 1.0) / lam
        out.append(torch.where(pos, y.to(torch.float32), x))
    return out


def onehot(xs: list[Tensor], lo: list[float], hi: list[float], classes: list[int],
           keep: list[int] | None = None) -> list[Tensor]:
    out = []
    keep = keep or classes
    for x, lo_f, hi_f, c, k in zip(xs, lo, hi, classes, keep, strict=True):
        xf = x.reshape(-1).to(torch.float32)
        l32, h32 = torch.tensor(lo_f, dtype=torch.float32), torch.tensor(hi_f, dtype=torch.float32)
        q = (xf - l32.to(xf.device)) / ((h32 - l32) / float(c)).to(xf.device)
        idx = torch.where((q >= 0) & (q < c), q, torch.zeros_like(q)).to(torch.int64)
        out.append((idx.unsqueeze(1) == torch.arange(min(c, k), device=x.device)).to(torch.float32))
    return out


def ngram_index(w: int, n: int, device: torch.device) -> Tensor:
    k = min(n, w)
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return (torch.arange(w - k + 1, device=device)[:, None] + torch.arange(k, device=device)[None, :]).reshape(-1)


def firstx(xs: list[Tensor], X: list[int]) -> list[Tensor]:
    return [x[:, :k].contiguous() for x, k in zip(xs, X, strict=True)]


def ngram(xs: list[Tensor], n: list[int]) -> list[Tensor]:
    return [x.index_select(1, ngram_index(x.shape[1], k, x.device)) for x, k in zip(xs, n, strict=True)]


def _positions(lengths: Tensor) -> tuple[Tensor, Tensor]:
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return rows, torch.arange(rows.numel(), device=lengths.device) - starts[rows]


def firstx_jagged(values: list[Tensor], lengths: list[Tensor], X: list[int]) -> list[Tensor]:
    vs, ls = [], []
    for v, ln, k in zip(values, lengths, X, strict=True):
        ln = ln.to(torch.int64)
        _, pos = _positions(ln)
        vs.append(v[pos < k])
        ls.append(torch.clamp(ln, max=k))
    return vs + ls


def ngram_jagged(values: list[Tensor], lengths: list[Tensor], n: list[int]) -> list[Tensor]:
    vs, ls = [], []
    for v, ln, m in zip(values, lengths, n, strict=True):
        ln = ln.to(torch.int64)
        k = torch.clamp(ln, max=m)
        out_len = (ln - k + 1) * k
        rows, pos = _positions(out_len)
        starts = torch.cumsum(ln, 0) - ln
        kr = k[rows].clamp(min=1)
        vs.append(v[starts[rows] + pos // kr + pos % kr])
        ls.append(out_len)
    return vs + ls
