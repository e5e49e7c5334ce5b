"""One nn.Module per op, applied to a group of features at once: x[B, g] (one width-1 column per feature)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from recforge.preprocess import ops


class Step(nn.Module):
    def forward(self, x: Tensor, valid: Tensor) -> Tensor:  # valid: the group's source validity mask
        raise NotImplementedError


class FillNull(Step):
    def __init__(self, value: float, kind: str):
        super().__init__()
        self.value, self.kind = value, kind

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.fill_null(x, valid, self.value, self.kind)


class Logit(Step):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.logit(x, self.eps)


class BoxCox(Step):
    def __init__(self, lmbda: float):
        super().__init__()
        self.lmbda = lmbda

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.boxcox(x, self.lmbda)


class Bucketize(Step):
    def __init__(self, borders: list[float]):
        super().__init__()
        self.register_buffer("borders", torch.tensor(borders, dtype=torch.float32), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.bucketize(x, self.borders)


class Clamp(Step):
    def __init__(self, lo: float, hi: float):
        super().__init__()
        self.lo, self.hi = lo, hi

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        if x.dtype == torch.int64:
            return ops.clamp(x, int(self.lo), int(self.hi))
        return ops.clamp(x, self.lo, self.hi)


class FirstX(Step):
    """Each column is one feature's width-1 list: firstx applies per feature ([B*g, 1] -> [B*g, min(X, 1)])."""

    def __init__(self, X: int):
        super().__init__()
        self.X = X

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.firstx(x.reshape(-1, 1), self.X).reshape(x.shape)


class SigridHash(Step):
    """One salt for the group, one modulus per column (features differ in table size)."""

    def __init__(self, salt: int, moduli: list[int]):
        super().__init__()
        self.salt = salt
        self.register_buffer("moduli", torch.tensor(moduli, dtype=torch.int64), persistent=False)

    def forward(self, x: Tensor, valid: Tensor) -> Tensor:
        return ops.sigrid_hash(x, self.salt, self.moduli)


def build_step(op: str, params: dict[str, Any], column_params: list[dict[str, Any]], source_kind: str) -> Step:
    """`params`: the group's shared parameters; `column_params`: each feature's own (only sigrid_hash's M differs)."""
    if op == "fill_null":
        return FillNull(params["value"], source_kind)
    if op == "logit":
        return Logit(params["eps"])
    if op == "boxcox":
        return BoxCox(params["lambda"])
    if op == "bucketize":
        return Bucketize(params["borders"])
    if op == "clamp":
        return Clamp(params["lo"], params["hi"])
    if op == "firstx":
        return FirstX(params["X"])
    if op == "sigrid_hash":
        return SigridHash(params["salt"], [p["M"] for p in column_params])
    raise ValueError(f"build_step: no step for op {op!r}")


# Parameters that may differ between the features of one group (they become per-column tensors).
PER_COLUMN = {"sigrid_hash": {"M"}}
