"""Plain-torch reference of ``recforge::embedding_layer``: the same metadata, one column at a time with
ordinary torch ops (bucketize, remainder, the sigrid_hash op, index_add). Slow and obvious; the C++ and
Triton implementations are tested against it."""
from __future__ import annotations

import torch
from torch import Tensor

from recforge_kernels import embedding_layout as L
from recforge_kernels.sigrid_hash import sigrid_hash


def _column(t: Tensor, col: int) -> Tensor:
    return t[:, col] if col >= 0 else t


def _in_span(x: Tensor, lo: int, hi: int, outside: int) -> Tensor:
    inside = (x >= lo) & (x <= hi)
    return ~inside if outside else inside


def translate(inputs: list[Tensor], fbuf: Tensor, ibuf: Tensor, row: list[int]) -> tuple[Tensor, Tensor]:
    """(ids int64, removed bool) for one column's values."""
    x = _column(inputs[row[L.F["in_value"]]], row[L.F["in_col"]])
    removed = torch.zeros(x.shape[0], dtype=torch.bool)
    is_float = x.is_floating_point()
    if not is_float:
        x = x.to(torch.int64)
    for s in range(row[L.F["nsteps"]]):
        op, p0, p1, p2, p3, p4 = row[L.STEP_BASE + s * L.STEP_WIDTH: L.STEP_BASE + (s + 1) * L.STEP_WIDTH]
        if op == L.OP_BUCKETIZE:
            if p3 == 1:
                x = torch.bucketize(x.double(), fbuf[p0: p0 + p1], right=bool(p2))
            else:
                x = torch.bucketize(x.to(torch.int64), ibuf[p0: p0 + p1], right=bool(p2))
            is_float = False
        elif op == L.OP_SELECT:
            flag = _column(inputs[p0], p1).to(torch.int64)
            x = torch.where((flag >= p2) & (flag <= p3), x, torch.full_like(x, p4))
        elif op == L.OP_MOD:
            x = torch.remainder(x, p0)
        elif op == L.OP_SIGRID:
            x = sigrid_hash(x, p0, p1)
        elif op == L.OP_CLAMP:
            x = x.clamp(p0, p1)
        elif op == L.OP_ADD:
            x = x + p0
        elif op == L.OP_REPLACE:
            x = torch.where(_in_span(x, p0, p1, p2), x, torch.full_like(x, p3))
        elif op == L.OP_REMOVE:
            removed |= ~_in_span(x, p0, p1, p2)
        else:
            raise ValueError(f"unknown step op {op}")
    if is_float:
        raise ValueError("a float column reached its lookup without a bucketize")
    return x, removed


def embedding_layer_reference(inputs: list[Tensor], weights: Tensor, fbuf: Tensor, ibuf: Tensor, meta: Tensor,
                              batch: int, total_dim: int) -> Tensor:
    out = torch.zeros(batch, total_dim, dtype=torch.float32)
    for i, row in enumerate(meta.tolist()):
        rows, dim, w_off, out_off = (row[L.F[k]] for k in ("rows", "dim", "w_off", "out_off"))
        table = weights[w_off: w_off + rows * dim].view(rows, dim)
        ids, removed = translate(inputs, fbuf, ibuf, row)
        live = ids[~removed]
        if bool(((live < 0) | (live >= rows)).any()):
            bad = live[(live < 0) | (live >= rows)][0].item()
            raise IndexError(f"embedding_layer: column {i} looked up id {bad} outside its table of {rows} rows")
        lengths_at = row[L.F["in_lengths"]]
        lookup = row[L.F["lookup"]]
        if lookup == L.LOOKUP_GATHER and lengths_at < 0:
            safe = torch.where(removed, torch.zeros_like(ids), ids)
            block = table[safe] * (~removed).unsqueeze(1).float()
        else:
            if lengths_at >= 0:
                lengths = inputs[lengths_at].to(torch.int64)
                seg = torch.repeat_interleave(torch.arange(batch), lengths)
            else:
                seg = torch.arange(batch)
            keep = ~removed
            block = torch.zeros(batch, dim).index_add(0, seg[keep], table[ids[keep]])
            counts = torch.zeros(batch).index_add(0, seg[keep], torch.ones(int(keep.sum())))
            if lookup == L.LOOKUP_MEAN:
                block = block / counts.clamp(min=1).unsqueeze(1)
            empty = counts == 0
            e = row[L.F["empty_id"]]
            fill = table[e] if 0 <= e < rows else torch.zeros(dim)
            block = torch.where(empty.unsqueeze(1), fill.expand(batch, dim), block)
        out[:, out_off: out_off + dim] = block
    return out
