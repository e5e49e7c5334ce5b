"""One nn.Module per op, applied to a group of g features at once: x[B, g, w] (w values per row and feature).

Scalar parameters may differ between the features of a group (they become [g] buffers broadcast over [1, g, 1]);
parameters that change shapes or tables (X, n, C, borders, map, cast target, salt) are the same within a group.
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from recforge.preprocess.semantics import ops
from recforge.preprocess.semantics.registry import Value

# Parameters that may differ between the features of one group (they become per-feature tensors).
PER_COLUMN = {
    "fill_null": {"value"}, "logit": {"eps"}, "boxcox": {"lambda"}, "clamp": {"lo", "hi"},
    "sigrid_hash": {"M"}, "onehot": {"lo", "hi"},
}


class Step(nn.Module):
    def forward(self, x: Tensor, valid: Tensor) -> Tensor:  # x [B, g, w]; valid: the source mask [B, g]
        raise NotImplementedError


def _per_feature(values: list[float], dtype: torch.dtype) -> Tensor:
    return torch.tensor(values, dtype=dtype).view(1, -1, 1)


class FillNull(Step):
    value: Tensor  # buffer

    def __init__(self, values: list[float], kind: str):
        super().__init__()
        self.kind = kind
        dtype = torch.float32 if kind == "dense" else torch.int64
        self.register_buffer("value", _per_feature(values, dtype), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        dtype = torch.float32 if self.kind == "dense" else torch.int64
        return torch.where(valid.unsqueeze(-1), x.to(dtype), self.value)


class Cast(Step):
    def __init__(self, to: Literal["float", "id"]):
        super().__init__()
        self.target = to  # not `to`: that would shadow nn.Module.to

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.cast(x, self.target)


class Logit(Step):
    lo: Tensor  # buffer
    hi: Tensor  # buffer

    def __init__(self, eps: list[float]):
        super().__init__()
        # both bounds rounded from double, as torch.clamp(x, eps, 1 - eps) and the reference do
        self.register_buffer("lo", _per_feature(eps, torch.float32), persistent=False)
        self.register_buffer("hi", _per_feature([1.0 - e for e in eps], torch.float32), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.logit(x, (self.lo, self.hi))


class Log1p(Step):
    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.log1p(x)


class BoxCox(Step):
    lmbda: Tensor  # buffer

    def __init__(self, lmbda: list[float]):
        super().__init__()
        self.register_buffer("lmbda", _per_feature(lmbda, torch.float32), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.boxcox(x, self.lmbda)


class Bucketize(Step):
    borders: Tensor  # buffer

    def __init__(self, borders: list[float]):
        super().__init__()
        self.register_buffer("borders", torch.tensor(borders, dtype=torch.float32), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.bucketize(x, self.borders)


class Clamp(Step):
    lo: Tensor  # buffer
    hi: Tensor  # buffer

    def __init__(self, lo: list[float], hi: list[float], dtype: torch.dtype):
        super().__init__()
        if dtype == torch.int64:
            lo, hi = [int(v) for v in lo], [int(v) for v in hi]
        self.register_buffer("lo", _per_feature(lo, dtype), persistent=False)
        self.register_buffer("hi", _per_feature(hi, dtype), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.clamp(x, self.lo, self.hi)


class FirstX(Step):
    def __init__(self, X: int):
        super().__init__()
        self.X = X

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.firstx(x, self.X)


class NGram(Step):
    index: Tensor  # buffer

    def __init__(self, n: int, width: int):
        super().__init__()
        self.register_buffer("index", ops.ngram_index(width, n), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return x.index_select(-1, self.index)


class OneHot(Step):
    lo: Tensor  # buffer
    hi: Tensor  # buffer

    def __init__(self, lo: list[float], hi: list[float], C: int):
        super().__init__()
        self.C = C
        self.register_buffer("lo", _per_feature(lo, torch.float32), persistent=False)
        self.register_buffer("hi", _per_feature(hi, torch.float32), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.onehot(x, self.lo, self.hi, self.C)


class MapId(Step):
    table: Tensor  # buffer

    def __init__(self, table: list[int]):
        super().__init__()
        self.register_buffer("table", torch.tensor(table, dtype=torch.int64), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.mapid(x, self.table)


class SigridHash(Step):
    """One salt for the group, one modulus per feature (features differ in table size)."""

    moduli: Tensor  # buffer
    def __init__(self, salt: int, moduli: list[int], inline: bool = False):
        super().__init__()
        self.salt, self.inline = salt, inline
        self.register_buffer("moduli", torch.tensor(moduli, dtype=torch.int64), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        if self.inline:  # plain torch ops: torch.compile can fuse the whole hash
            return ops.sigrid_hash_inline(x, self.salt, self.moduli.view(1, -1, 1))
        b, g, w = x.shape
        y = ops.sigrid_hash(x.transpose(1, 2).reshape(b * w, g), self.salt, self.moduli)
        return y.reshape(b, w, g).transpose(1, 2)


def build_step(
    op: str, params: dict[str, Any], column_params: list[dict[str, Any]], source_kind: str,
    value: Value | None = None, inline_hash: bool = False,
) -> Step:
    """`params`: the group's shared parameters; `column_params`: each feature's own; `value`: the input's type
    and width (needed by clamp and ngram)."""
    col = lambda name: [p[name] for p in column_params]  # noqa: E731
    if op == "fill_null":
        return FillNull(col("value"), source_kind)
    if op == "cast":
        return Cast(params["to"])
    if op == "logit":
        return Logit(col("eps"))
    if op == "log1p":
        return Log1p()
    if op == "boxcox":
        return BoxCox(col("lambda"))
    if op == "bucketize":
        return Bucketize(params["borders"])
    if op == "clamp":
        return Clamp(col("lo"), col("hi"), torch.int64 if value is not None and value.type == "id" else torch.float32)
    if op == "firstx":
        return FirstX(params["X"])
    if op == "ngram":
        return NGram(params["n"], value.width if value is not None else 1)
    if op == "onehot":
        return OneHot(col("lo"), col("hi"), params["C"])
    if op == "mapid":
        return MapId(params["map"])
    if op == "sigrid_hash":
        return SigridHash(params["salt"], col("M"), inline=inline_hash)
    raise ValueError(f"build_step: no step for op {op!r}")
