"""The Executor seam: plan + RawBatch -> (dense float32[B, Fd], KeyedJaggedTensor of ids). Eager torch here;
fused / GPU executors plug in behind the same Protocol."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.module import PreprocessModule
from recforge.preprocess.plan import Plan


@runtime_checkable
class Executor(Protocol):
    def __call__(self, raw: RawBatch) -> tuple[Tensor, KeyedJaggedTensor]: ...


def ids_to_kjt(ids: Tensor, keys: list[str]) -> KeyedJaggedTensor:
    """ids int64[B, F] (one id per row and feature) -> KJT with `keys`, values key-major, lengths all 1."""
    rows, n = ids.shape
    if n != len(keys):
        raise ValueError(f"ids_to_kjt: {n} id columns for {len(keys)} keys")
    return KeyedJaggedTensor(
        keys=list(keys),
        values=ids.t().contiguous().view(-1),
        lengths=torch.ones(n * rows, dtype=torch.int32, device=ids.device),
        stride=rows,
    )


class TorchExecutor:
    """Runs PreprocessModule eagerly, on whatever device the batch is on."""

    def __init__(self, plan: Plan, dataset: DatasetConfig):
        self.plan, self.dataset = plan, dataset
        self.module = PreprocessModule(plan, dataset)
        self.keys = plan.sparse_features()
        self._device = torch.device("cpu")

    @torch.no_grad()
    def __call__(self, raw: RawBatch) -> tuple[Tensor, KeyedJaggedTensor]:
        if raw.dense.device != self._device:
            self._device = raw.dense.device
            self.module.to(self._device)
        dense, ids = self.module(raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid)
        return dense, ids_to_kjt(ids, self.keys)
