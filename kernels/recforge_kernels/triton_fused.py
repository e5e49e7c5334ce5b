"""Triton kernels for the fused ops on CUDA, RAP's grid: program_id(0) is the feature, program_id(1) a block of its
values. A group's inputs are concatenated into one flat buffer with int64 offsets[F + 1]; per-feature parameters
live in device arrays. The results are views into one output buffer. Import fails without triton (fused.py then
keeps the torch fallback for CUDA tensors). On CPU the kernels run under TRITON_INTERPRET=1, which is how the
tests check them against the fused torch fallback.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024
KMUL = 0x9DDFEA08EB382D69
KMUL_S = KMUL - (1 << 64)  # the same bits as a signed int64


def _flat(xs: list[Tensor]) -> tuple[Tensor, Tensor, int]:
    sizes = [x.numel() for x in xs]
    offsets = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(xs[0].device)
    return torch.cat([x.reshape(-1) for x in xs]), offsets, max(sizes) if sizes else 0


def _split(flat: Tensor, xs: list[Tensor], shapes=None) -> list[Tensor]:
    sizes = [x.numel() for x in xs] if shapes is None else [int(torch.tensor(s).prod()) for s in shapes]
    parts = torch.split(flat, sizes)
    shapes = shapes if shapes is not None else [x.shape for x in xs]
    return [p.view(s) for p, s in zip(parts, shapes, strict=True)]


def _grid(f: int, n: int):
    return (f, max(1, triton.cdiv(n, BLOCK)))


def _params(values, dtype, device) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


@triton.jit
def _span(off_ptr):
    f = tl.program_id(0)
    start = tl.load(off_ptr + f)
    end = tl.load(off_ptr + f + 1)
    i = start + tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return f, i, i < end


BLOCK_C: tl.constexpr = BLOCK


@triton.jit
def _lsr(x, k: tl.constexpr):
    """Logical right shift of int64 bits."""
    return (x.to(tl.uint64, bitcast=True) >> k).to(tl.int64, bitcast=True)


@triton.jit
def _sigrid_hash_kernel(x_ptr, y_ptr, off_ptr, salt_ptr, mod_ptr):
    # int64 arithmetic wraps like the C++ uint64 code; only the right shifts need the unsigned view
    f, i, m = _span(off_ptr)
    key = tl.load(x_ptr + i, mask=m, other=0)
    key = (~key) + (key << 21)
    key = key ^ _lsr(key, 24)
    key = key + (key << 3) + (key << 8)
    key = key ^ _lsr(key, 14)
    key = key + (key << 2) + (key << 4)
    key = key ^ _lsr(key, 28)
    key = key + (key << 31)
    salt = tl.load(salt_ptr + f)
    kmul = tl.full((), KMUL_S, tl.int64)
    a = (key ^ salt) * kmul
    a = a ^ _lsr(a, 47)
    b = (salt ^ a) * kmul
    b = b ^ _lsr(b, 47)
    h = b * kmul
    mod = tl.load(mod_ptr + f)
    r = h % mod  # C semantics (truncated): floor it
    r = tl.where(r < 0, r + mod, r)
    tl.store(y_ptr + i, r, mask=m)


@triton.jit
def _logit_kernel(x_ptr, y_ptr, off_ptr, lo_ptr, hi_ptr):
    f, i, m = _span(off_ptr)
    x = tl.load(x_ptr + i, mask=m, other=0.5)
    lo = tl.load(lo_ptr + f)
    hi = tl.load(hi_ptr + f)
    t = tl.where(x < lo, lo, x)  # NaN fails both tests and stays NaN
    t = tl.where(t > hi, hi, t).to(tl.float64)
    tl.store(y_ptr + i, tl.log(t / (1.0 - t)).to(tl.float32), mask=m)


@triton.jit
def _log1p_kernel(x_ptr, y_ptr, off_ptr):
    f, i, m = _span(off_ptr)
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float64)
    x = tl.where(x < 0, 0.0, x)  # NaN fails the test and stays NaN
    # log1p without a libdevice call (the interpreter and every backend have log): u = 1 + x rounded;
    # log(u) * x / (u - 1) corrects the rounding of u (Goldberg), exact enough in float64 for a float32 result
    u = 1.0 + x
    d = tl.where(u == 1.0, 1.0, u - 1.0)
    y = tl.where(u == 1.0, x, tl.log(u) * (x / d))
    y = tl.where(x == float("inf"), x, y)
    tl.store(y_ptr + i, y.to(tl.float32), mask=m)


@triton.jit
def _boxcox_kernel(x_ptr, y_ptr, off_ptr, lam_ptr):
    f, i, m = _span(off_ptr)
    x = tl.load(x_ptr + i, mask=m, other=1.0)
    lam = tl.load(lam_ptr + f).to(tl.float64)
    pos = x > 0
    safe = tl.where(pos, x, 1.0).to(tl.float64)
    lg = tl.log(safe)
    y = tl.where(lam == 0, lg, (tl.exp(lam * lg) - 1.0) / tl.where(lam == 0, 1.0, lam))
    tl.store(y_ptr + i, tl.where(pos, y.to(tl.float32), x), mask=m)


@triton.jit
def _clamp_kernel(x_ptr, y_ptr, off_ptr, lo_ptr, hi_ptr):
    f, i, m = _span(off_ptr)
    x = tl.load(x_ptr + i, mask=m)
    lo = tl.load(lo_ptr + f)
    hi = tl.load(hi_ptr + f)
    x = tl.where(x < lo, lo, x)
    tl.store(y_ptr + i, tl.where(x > hi, hi, x), mask=m)


@triton.jit
def _bucketize_kernel(x_ptr, y_ptr, off_ptr, b_ptr, boff_ptr, MAX_K: tl.constexpr):
    f, i, m = _span(off_ptr)
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    b0 = tl.load(boff_ptr + f)
    nb = tl.load(boff_ptr + f + 1) - b0
    acc = tl.zeros_like(i)
    for k in tl.static_range(MAX_K):  # unrolled to the group's most borders; missing ones are +inf
        b = tl.load(b_ptr + b0 + k, mask=k < nb, other=float("inf"))
        acc += (x > b).to(tl.int64)
    tl.store(y_ptr + i, acc, mask=m)


@triton.jit
def _mapid_kernel(x_ptr, y_ptr, off_ptr, t_ptr, toff_ptr):
    f, i, m = _span(off_ptr)
    x = tl.load(x_ptr + i, mask=m, other=0)
    t0 = tl.load(toff_ptr + f)
    n = tl.load(toff_ptr + f + 1) - t0
    inside = (x >= 0) & (x < n)
    y = tl.load(t_ptr + t0 + tl.where(inside, x, 0), mask=m & inside, other=0)
    tl.store(y_ptr + i, y, mask=m)


@triton.jit
def _cast_id_kernel(x_ptr, y_ptr, off_ptr):
    f, i, m = _span(off_ptr)
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    big = x >= 9223372036854775808.0
    small = x < -9223372036854775808.0
    y = tl.where(big | small | (x != x), 0.0, x).to(tl.int64)  # float -> int truncates
    y = tl.where(big, 9223372036854775807, y)
    y = tl.where(small, -9223372036854775807 - 1, y)
    tl.store(y_ptr + i, y, mask=m)


@triton.jit
def _fill_null_kernel(x_ptr, v_ptr, y_ptr, off_ptr, fill_ptr, DENSE: tl.constexpr):
    f, i, m = _span(off_ptr)
    x = tl.load(x_ptr + i, mask=m, other=0)
    ok = tl.load(v_ptr + i, mask=m, other=0) != 0
    fill = tl.load(fill_ptr + f)
    if DENSE:
        tl.store(y_ptr + i, tl.where(ok, x.to(tl.float32), fill.to(tl.float32)), mask=m)
    else:
        tl.store(y_ptr + i, tl.where(ok, x, fill.to(tl.int64)), mask=m)


@triton.jit
def _fill_null_columns_kernel(x_ptr, v_ptr, y_ptr, col_ptr, fill_ptr, rows, width, DENSE: tl.constexpr):
    f = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = r < rows
    c = tl.load(col_ptr + f)
    x = tl.load(x_ptr + r * width + c, mask=m, other=0)
    ok = tl.load(v_ptr + r * width + c, mask=m, other=0) != 0
    fill = tl.load(fill_ptr + f)
    if DENSE:
        tl.store(y_ptr + f * rows + r, tl.where(ok, x.to(tl.float32), fill.to(tl.float32)), mask=m)
    else:
        tl.store(y_ptr + f * rows + r, tl.where(ok, x, fill.to(tl.int64)), mask=m)


@triton.jit
def _onehot_kernel(x_ptr, y_ptr, off_ptr, yoff_ptr, lo_ptr, hi_ptr, c_ptr, k_ptr, MAX_C: tl.constexpr):
    f, i, m = _span(off_ptr)
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    lo = tl.load(lo_ptr + f)
    C = tl.load(c_ptr + f)
    step = (tl.load(hi_ptr + f) - lo) / C.to(tl.float32)
    q = (x - lo) / step
    idx = tl.where((q >= 0) & (q < C.to(tl.float32)), q, 0.0).to(tl.int64)
    K = tl.load(k_ptr + f)  # columns kept: the first K of C
    row = i - tl.load(off_ptr + f)
    base = tl.load(yoff_ptr + f) + row * K
    for c in tl.static_range(MAX_C):
        tl.store(y_ptr + base + c, tl.where(idx == c, 1.0, 0.0), mask=m & (c < K))


@triton.jit
def _windows_kernel(x_ptr, y_ptr, yoff_ptr, xoff_ptr, w_ptr, k_ptr, win_ptr, rows_ptr):
    """Row r of feature f ([rows, w] at xoff[f]) -> its first win[f] windows of k[f] values, at yoff[f]."""
    f = tl.program_id(0)
    w = tl.load(w_ptr + f)
    k = tl.load(k_ptr + f)
    wo = tl.load(win_ptr + f) * k
    j = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # output element within the feature
    m = j < tl.load(rows_ptr + f) * wo
    r = j // tl.maximum(wo, 1)
    p = j - r * wo
    src = r * w + p // tl.maximum(k, 1) + p % tl.maximum(k, 1)
    tl.store(y_ptr + tl.load(yoff_ptr + f) + j, tl.load(x_ptr + tl.load(xoff_ptr + f) + src, mask=m), mask=m)


# ---------------------------------------------------------------- host wrappers (same signatures as fused_torch)


def _elementwise(kernel, xs, out_dtype, *params, **constexprs):
    x, off, n = _flat(xs)
    y = torch.empty(x.numel(), dtype=out_dtype, device=x.device)
    kernel[_grid(len(xs), n)](x, y, off, *params, **constexprs)
    return _split(y, xs)


def sigrid_hash(xs, salts, moduli):
    d = xs[0].device
    return _elementwise(_sigrid_hash_kernel, xs, torch.int64, _params(salts, torch.int64, d),
                        _params(moduli, torch.int64, d))


def logit(xs, lo, hi):
    d = xs[0].device
    return _elementwise(_logit_kernel, xs, torch.float32, _params(lo, torch.float32, d), _params(hi, torch.float32, d))


def log1p(xs):
    return _elementwise(_log1p_kernel, xs, torch.float32)


def boxcox(xs, lambdas):
    lam = [float(torch.tensor(v, dtype=torch.float32)) for v in lambdas]
    return _elementwise(_boxcox_kernel, xs, torch.float32, _params(lam, torch.float32, xs[0].device))


def clamp_float(xs, lo, hi):
    d = xs[0].device
    return _elementwise(_clamp_kernel, xs, torch.float32, _params(lo, torch.float32, d), _params(hi, torch.float32, d))


def clamp_id(xs, lo, hi):
    d = xs[0].device
    return _elementwise(_clamp_kernel, xs, torch.int64, _params(lo, torch.int64, d), _params(hi, torch.int64, d))


def bucketize(xs, borders, offsets):
    d = xs[0].device
    most = max(b - a for a, b in itertools.pairwise(offsets))
    return _elementwise(_bucketize_kernel, xs, torch.int64, borders.to(device=d, dtype=torch.float32),
                        _params(offsets, torch.int64, d), MAX_K=triton.next_power_of_2(most))


def mapid(xs, table, offsets):
    d = xs[0].device
    return _elementwise(_mapid_kernel, xs, torch.int64, table.to(device=d, dtype=torch.int64),
                        _params(offsets, torch.int64, d))


def cast(xs, to_float):
    if to_float:
        return [x.to(torch.float32) for x in xs]
    return _elementwise(_cast_id_kernel, xs, torch.int64)


def fill_null(xs, valids, values, dense):
    x, off, n = _flat(xs)
    v, _, _ = _flat(valids)
    y = torch.empty(x.numel(), dtype=torch.float32 if dense else torch.int64, device=x.device)
    _fill_null_kernel[_grid(len(xs), n)](x, v, y, off, _params(values, torch.float64, x.device), DENSE=dense)
    return _split(y, xs)


def fill_null_columns(x, valid, cols, values, dense):
    rows, width = x.shape
    y = torch.empty(len(cols) * rows, dtype=torch.float32 if dense else torch.int64, device=x.device)
    _fill_null_columns_kernel[_grid(len(cols), rows)](
        x.contiguous(), valid.contiguous(), y, _params(cols, torch.int64, x.device),
        _params(values, torch.float64, x.device), rows, width, DENSE=dense)
    return list(y.view(len(cols), rows).unbind(0))


def onehot(xs, lo, hi, classes, keep=None):
    d = xs[0].device
    keep = [min(c, k) for c, k in zip(classes, keep or classes, strict=True)]
    x, off, n = _flat([t.reshape(-1).to(torch.float32) for t in xs])
    shapes = [(t.shape[0], k) for t, k in zip(xs, keep, strict=True)]
    yoff = torch.tensor([0] + [r * c for r, c in shapes], dtype=torch.int64).cumsum(0).to(d)
    y = torch.empty(int(yoff[-1]), dtype=torch.float32, device=d)
    _onehot_kernel[_grid(len(xs), n)](x, y, off, yoff, _params(lo, torch.float32, d), _params(hi, torch.float32, d),
                                      _params(classes, torch.int64, d), _params(keep, torch.int64, d),
                                      MAX_C=max(keep))
    return _split(y, xs, shapes)


def _windows(xs, ks_and_windows):
    d = xs[0].device
    x, xoff, _ = _flat(xs)
    shapes = [(t.shape[0], win * k) for t, (k, win) in zip(xs, ks_and_windows, strict=True)]
    sizes = [r * c for r, c in shapes]
    yoff = torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0).to(d)
    y = torch.empty(int(yoff[-1]), dtype=x.dtype, device=d)
    widths = [t.shape[1] for t in xs]
    _windows_kernel[_grid(len(xs), max(sizes) if sizes else 0)](
        x, y, yoff, xoff, _params(widths, torch.int64, d), _params([k for k, _ in ks_and_windows], torch.int64, d),
        _params([win for _, win in ks_and_windows], torch.int64, d), _params([t.shape[0] for t in xs], torch.int64, d))
    return _split(y, xs, shapes)


def firstx(xs, X):
    return _windows(xs, [(min(k, t.shape[1]), 1) for t, k in zip(xs, X, strict=True)])


def ngram(xs, n):
    kw = []
    for t, m in zip(xs, n, strict=True):
        k = min(m, t.shape[1])
        kw.append((k, t.shape[1] - k + 1 if k else 0))
    return _windows(xs, kw)


KERNELS: dict[str, Callable[..., list[Tensor]]] = {
    "sigrid_hash": sigrid_hash, "logit": logit, "log1p": log1p, "boxcox": boxcox, "clamp_float": clamp_float,
    "clamp_id": clamp_id,
    "bucketize": bucketize, "mapid": mapid, "cast": cast, "fill_null": fill_null, "onehot": onehot,
    "firstx": firstx, "ngram": ngram, "fill_null_columns": fill_null_columns,
}
