"""CUDA implementation of ``recforge::embedding_layer`` in Triton: one program per (column, row tile).

Data-driven: each program reads its column's metadata row (``embedding_layout``), so Triton compiles one kernel
whatever the model, and the host never reads tensor contents unless a column is bounds-checked. The CPU kernel and
the plain-torch reference define the semantics; ``tests/unit/test_recom_triton_interpret.py`` checks this kernel
against them under the Triton interpreter. Design: docs/recom.md#the-fused-embedding-op; not yet run on a GPU:
docs/known_limits.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from recforge_kernels import embedding_layout as L

_DTYPE = {torch.int64: 0, torch.int32: 1, torch.float32: 2, torch.float64: 3, torch.bool: 4, torch.uint8: 5,
          torch.int16: 6, torch.int8: 7}
KMUL = tl.constexpr(0x9DDFEA08EB382D69)
TILE_ROWS = 32
K_BLOCK = 16


@triton.jit
def _load_value(table_ptr, idx, e, col, mask):
    """Element e (vector) of input idx (scalar) as (int64, float64): its address, strides and dtype come
    from the pointer table [addr, stride0, stride1, dtype]."""
    addr = tl.load(table_ptr + idx * 4)
    s0 = tl.load(table_ptr + idx * 4 + 1)
    s1 = tl.load(table_ptr + idx * 4 + 2)
    dt = tl.load(table_ptr + idx * 4 + 3)
    k = e * s0 + tl.maximum(col, 0) * s1
    xi = tl.zeros(e.shape, tl.int64)
    xf = tl.zeros(e.shape, tl.float64)
    if dt == 0:
        xi = tl.load(addr.to(tl.pointer_type(tl.int64)) + k, mask=mask, other=0)
        xf = xi.to(tl.float64)
    elif dt == 1:
        xi = tl.load(addr.to(tl.pointer_type(tl.int32)) + k, mask=mask, other=0).to(tl.int64)
        xf = xi.to(tl.float64)
    elif dt == 2:
        xf = tl.load(addr.to(tl.pointer_type(tl.float32)) + k, mask=mask, other=0.0).to(tl.float64)
        xi = xf.to(tl.int64)
    elif dt == 3:
        xf = tl.load(addr.to(tl.pointer_type(tl.float64)) + k, mask=mask, other=0.0)
        xi = xf.to(tl.int64)
    elif dt == 4 or dt == 5:
        xi = tl.load(addr.to(tl.pointer_type(tl.uint8)) + k, mask=mask, other=0).to(tl.int64)
        xf = xi.to(tl.float64)
    elif dt == 6:
        xi = tl.load(addr.to(tl.pointer_type(tl.int16)) + k, mask=mask, other=0).to(tl.int64)
        xf = xi.to(tl.float64)
    else:
        xi = tl.load(addr.to(tl.pointer_type(tl.int8)) + k, mask=mask, other=0).to(tl.int64)
        xf = xi.to(tl.float64)
    return xi, xf, dt


@triton.jit
def _twang(x):
    """twang_mix64 of int64 x, in uint64. ~ is taken in int64: the interpreter cannot invert a uint64."""
    key = x.to(tl.uint64, bitcast=True)
    key = (~x).to(tl.uint64, bitcast=True) + (key << 21)
    key = key ^ (key >> 24)
    key = key + (key << 3) + (key << 8)
    key = key ^ (key >> 14)
    key = key + (key << 2) + (key << 4)
    key = key ^ (key >> 28)
    key = key + (key << 31)
    return key


@triton.jit
def _floor_mod(x, n):
    r = x % n
    return tl.where(r < 0, r + n, r)


@triton.jit
def _in_span(x, lo, hi, outside):
    inside = (x >= lo) & (x <= hi)
    return tl.where(outside != 0, ~inside, inside)


@triton.jit
def _translate(meta_row, table_ptr, fbuf_ptr, ibuf_ptr, value_idx, col, e, mask,
               STEP_BASE: tl.constexpr, STEP_WIDTH: tl.constexpr, MAX_STEPS: tl.constexpr,
               SEARCH_STEPS: tl.constexpr, NSTEPS_AT: tl.constexpr):
    """ids (int64) and kept (bool) of elements e of a column."""
    xi, xf, dt = _load_value(table_ptr, value_idx, e, col, mask)
    is_float = (dt == 2) | (dt == 3)
    kept = mask
    nsteps = tl.load(meta_row + NSTEPS_AT)
    for s in tl.static_range(MAX_STEPS):
        if s < nsteps:
            st = meta_row + STEP_BASE + s * STEP_WIDTH
            op = tl.load(st)
            p0 = tl.load(st + 1)
            p1 = tl.load(st + 2)
            p2 = tl.load(st + 3)
            p3 = tl.load(st + 4)
            p4 = tl.load(st + 5)
            if op == 2:  # BUCKETIZE: first i with !(b[i] >= x) false (right: !(b[i] > x)), over K = p1
                lo = tl.zeros(e.shape, tl.int64)
                hi = tl.zeros(e.shape, tl.int64) + p1
                for _ in tl.static_range(SEARCH_STEPS):
                    active = lo < hi
                    mid = lo + (hi - lo) // 2
                    if p3 == 1:
                        b = tl.load(fbuf_ptr + p0 + mid, mask=active & mask, other=0.0)
                        xv = tl.where(is_float, xf, xi.to(tl.float64))
                        go_right = tl.where(p2 != 0, ~(b > xv), ~(b >= xv))
                    else:
                        bi = tl.load(ibuf_ptr + p0 + mid, mask=active & mask, other=0)
                        go_right = tl.where(p2 != 0, ~(bi > xi), ~(bi >= xi))
                    lo = tl.where(active & go_right, mid + 1, lo)
                    hi = tl.where(active & ~go_right, mid, hi)
                xi = lo
                is_float = False
            elif op == 1:  # SELECT on a flag input
                flag, _, _ = _load_value(table_ptr, p0, e, p1, mask)
                xi = tl.where((flag >= p2) & (flag <= p3), xi, p4)
            elif op == 3:  # MOD
                xi = _floor_mod(xi, p0)
            elif op == 4:  # SIGRID: hash_128_to_64(salt, twang_mix64(x)) floor-mod M
                upper = p0.to(tl.uint64, bitcast=True)
                a = (_twang(xi) ^ upper) * KMUL
                a = a ^ (a >> 47)
                b2 = (upper ^ a) * KMUL
                b2 = b2 ^ (b2 >> 47)
                b2 = b2 * KMUL
                xi = _floor_mod(b2.to(tl.int64, bitcast=True), p1)
            elif op == 5:  # CLAMP
                xi = tl.minimum(tl.maximum(xi, p0), p1)
            elif op == 6:  # ADD
                xi = xi + p0
            elif op == 7:  # REPLACE
                xi = tl.where(_in_span(xi, p0, p1, p2), xi, p3)
            elif op == 8:  # REMOVE
                kept = kept & _in_span(xi, p0, p1, p2)
    return xi, kept


@triton.jit
def _embedding_layer_kernel(meta_ptr, table_ptr, offs_ptr, weights_ptr, fbuf_ptr, ibuf_ptr, out_ptr, err_ptr,
                            batch, total_dim, tiles_per_col,
                            META_WIDTH: tl.constexpr, STEP_BASE: tl.constexpr, STEP_WIDTH: tl.constexpr,
                            MAX_STEPS: tl.constexpr, SEARCH_STEPS: tl.constexpr, TILE: tl.constexpr,
                            DBLOCK: tl.constexpr, KBLOCK: tl.constexpr, NSTEPS_AT: tl.constexpr):
    pid = tl.program_id(0)
    c = pid // tiles_per_col
    b0 = (pid % tiles_per_col) * TILE
    row = meta_ptr + c * META_WIDTH
    value_idx = tl.load(row + 0)
    col = tl.load(row + 1)
    lengths_idx = tl.load(row + 2)
    lookup = tl.load(row + 3)
    empty_id = tl.load(row + 4)
    rows = tl.load(row + 5)
    dim = tl.load(row + 6)
    w_off = tl.load(row + 7)
    out_off = tl.load(row + 8)
    check = tl.load(row + 9)
    d = tl.arange(0, DBLOCK)
    dmask = d < dim
    if lengths_idx < 0:
        b = b0 + tl.arange(0, TILE)
        bmask = b < batch
        ids, kept = _translate(row, table_ptr, fbuf_ptr, ibuf_ptr, value_idx, col, b.to(tl.int64), bmask,
                               STEP_BASE, STEP_WIDTH, MAX_STEPS, SEARCH_STEPS, NSTEPS_AT)
        bad = kept & ((ids < 0) | (ids >= rows))
        if check != 0:
            tl.atomic_max(err_ptr, tl.max(tl.where(bad, c + 1, 0), axis=0))
        kept = kept & ~bad
        # one value per row pooled (sum or mean of one): a removed value leaves an empty bag -> empty_id's row
        use_empty = bmask & ~kept & (lookup != 0) & (empty_id >= 0) & (empty_id < rows)
        safe = tl.where(kept, ids, tl.where(use_empty, empty_id, 0))
        vals = tl.load(weights_ptr + w_off + safe[:, None] * dim + d[None, :],
                       mask=(kept | use_empty)[:, None] & dmask[None, :], other=0.0)
        tl.store(out_ptr + b[:, None].to(tl.int64) * total_dim + out_off + d[None, :], vals,
                 mask=bmask[:, None] & dmask[None, :])
    else:
        offs_base = tl.load(offs_ptr + c)  # where this column's offsets[B + 1] start in the offsets buffer
        for r in range(TILE):  # a runtime loop: unrolling 32 bags made the sm_90 compile take over 10 min
            bb = b0 + r
            if bb < batch:
                start = tl.load(offs_ptr + offs_base + bb)
                end = tl.load(offs_ptr + offs_base + bb + 1)
                acc = tl.zeros((DBLOCK,), tl.float32)
                count = tl.zeros((), tl.int64)
                for k0 in range(start, end, KBLOCK):
                    k = k0 + tl.arange(0, KBLOCK)
                    kmask = k < end
                    ids, kept = _translate(row, table_ptr, fbuf_ptr, ibuf_ptr, value_idx, col, k.to(tl.int64),
                                           kmask, STEP_BASE, STEP_WIDTH, MAX_STEPS, SEARCH_STEPS, NSTEPS_AT)
                    bad = kept & ((ids < 0) | (ids >= rows))
                    if check != 0:
                        tl.atomic_max(err_ptr, tl.max(tl.where(bad, c + 1, 0), axis=0))
                    kept = kept & ~bad
                    safe = tl.where(kept, ids, 0)
                    vals = tl.load(weights_ptr + w_off + safe[:, None] * dim + d[None, :],
                                   mask=kept[:, None] & dmask[None, :], other=0.0)
                    acc += tl.sum(vals, axis=0)
                    count += tl.sum(kept.to(tl.int64), axis=0)
                if count == 0:
                    if (empty_id >= 0) & (empty_id < rows):
                        acc = tl.load(weights_ptr + w_off + empty_id * dim + d, mask=dmask, other=0.0)
                elif lookup == 2:
                    acc = acc / count.to(tl.float32)
                tl.store(out_ptr + bb.to(tl.int64) * total_dim + out_off + d, acc, mask=dmask)


assert [L.F[k] for k in ("in_value", "in_col", "in_lengths", "lookup", "empty_id", "rows", "dim", "w_off",
                         "out_off", "check")] == list(range(10)), "the kernel reads these fields by position"


def _pointer_table(inputs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    rows = []
    for t in inputs:
        if t.dtype not in _DTYPE:
            raise ValueError(f"embedding_layer: input dtype {t.dtype} is not supported")
        rows.append([t.data_ptr(), t.stride(0) if t.dim() else 0, t.stride(1) if t.dim() > 1 else 0, _DTYPE[t.dtype]])
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def embedding_layer_cuda(inputs, weights, fbuf, ibuf, meta, batch, total_dim):
    device = weights.device
    out = torch.empty(batch, total_dim, dtype=torch.float32, device=device)
    C = meta.shape[0]
    if batch == 0 or C == 0:
        return out
    meta_host = meta.cpu() if meta.device.type != "cpu" else meta
    lengths_at = meta_host[:, L.F["in_lengths"]].tolist()
    jagged = [i for i, j in enumerate(lengths_at) if j >= 0]
    # offsets: one [B + 1] row per jagged column, all in one buffer; column c's row starts at offs[c]
    head = torch.zeros(C, dtype=torch.int64)
    if jagged:
        lens = torch.stack([inputs[lengths_at[i]].to(device=device, dtype=torch.int64) for i in jagged])
        rows = torch.cat([torch.zeros(len(jagged), 1, dtype=torch.int64, device=device), lens.cumsum(1)], dim=1)
        for k, i in enumerate(jagged):
            head[i] = C + k * (batch + 1)
        offs = torch.cat([head.to(device), rows.reshape(-1)])
    else:
        offs = head.to(device)
    table = _pointer_table(inputs, device)
    kmax = int(max((r[L.STEP_BASE + s * L.STEP_WIDTH + 2] for r in meta_host.tolist()
                    for s in range(L.MAX_STEPS) if r[L.STEP_BASE + s * L.STEP_WIDTH] == L.OP_BUCKETIZE), default=1))
    dmax = int(meta_host[:, L.F["dim"]].max())
    err = torch.zeros(1, dtype=torch.int64, device=device)
    tiles = triton.cdiv(batch, TILE_ROWS)
    _embedding_layer_kernel[(C * tiles,)](
        meta.to(device), table, offs, weights, fbuf.to(device), ibuf.to(device), out, err,
        batch, total_dim, tiles,
        META_WIDTH=L.META_WIDTH, STEP_BASE=L.STEP_BASE, STEP_WIDTH=L.STEP_WIDTH, MAX_STEPS=L.MAX_STEPS,
        SEARCH_STEPS=max(1, (kmax + 1).bit_length()), TILE=TILE_ROWS, DBLOCK=triton.next_power_of_2(dmax),
        KBLOCK=K_BLOCK, NSTEPS_AT=L.F["nsteps"],
    )
    if bool(meta_host[:, L.F["check"]].any()):  # only bounds-checked columns need this one sync
        bad = int(err.item())
        if bad:
            raise IndexError(f"embedding_layer: column {bad - 1} looked up an id outside its table")
    return out
