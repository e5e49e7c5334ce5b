"""The Executor seam: plan + RawBatch -> (dense float32[B, Fd], KeyedJaggedTensor of ids).

`make_executor(name, plan, dataset)` builds one: "eager" (one torch op per feature per op), "fused" (one
custom-op launch per fused group, the default), "dali" (an NVIDIA DALI pipeline, fused for what DALI cannot
express). `TorchExecutor` runs the exportable PreprocessModule (one value per row and feature, as RECom needs).
"""
from __future__ import annotations

import logging
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executors.dali import DaliExecutor
from recforge.preprocess.executors.eager import EagerExecutor
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.executors.record import MODULE, ExecutionLog, process_log
from recforge.preprocess.module import LENGTHS_SUFFIX, PreprocessModule, module_kjt
from recforge.preprocess.planning.plan import Plan


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
        self.executed = ExecutionLog()  # per batch (recforge.preprocess.executors.record)

    @torch.no_grad()
    def __call__(self, raw: RawBatch) -> tuple[Tensor, KeyedJaggedTensor]:
        if raw.dense.device != self._device:
            self._device = raw.dense.device
            self.module.to(self._device)
        undeclared = [s for s in self.plan.sources() if s in raw.jagged and s not in self.module.list_columns]
        if undeclared:
            raise ValueError(f"TorchExecutor: columns {undeclared} arrive as lists but the dataset does not declare "
                             "them multi_hot")
        if self.module.list_columns:  # multi-hot columns: values + lengths, the third output per list feature
            jagged: dict[str, Tensor] = {}
            for name in self.module.list_columns:
                col = raw.jagged[name]
                jagged[name], jagged[name + LENGTHS_SUFFIX] = col.values, col.lengths
            dense, ids, lists = self.module(raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid, jagged)
            kjt = module_kjt(self.keys, ids, lists)
        else:
            dense, ids = self.module(raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid)
            kjt = ids_to_kjt(ids, self.keys)
        for counts in (self.executed, process_log()):
            counts.add(MODULE, native=False, reason="PreprocessModule (torch ops, exportable)")
        return dense, kjt

    def describe(self) -> dict[str, Any]:
        return {"executor": "module", "plan": self.plan.name, "groups": len(self.module.groups),
                "executed": self.executed.snapshot()}


ExecutorName = Literal["eager", "fused", "dali"]
EXECUTORS: tuple[str, ...] = ("eager", "fused", "dali")
log = logging.getLogger(__name__)


def make_executor(name: str, plan: Plan, dataset: DatasetConfig, **options: Any) -> Executor:
    """Build the named executor for `plan` over `dataset` (the plan is validated: PlanError names feature and op).
    Options: fused/dali take `method` ("milp" | "greedy") for the plan compiler; fused takes `prune` (skip values
    no consumer reads, default True) and `native` (False: the ops' torch fallback); dali takes `num_threads` and
    `device` ("cpu" | "gpu"). What each batch ran is counted (recforge.preprocess.executors.record)."""
    ex: Executor
    if name == "eager":
        ex = EagerExecutor(plan, dataset)
    elif name == "fused":
        ex = FusedExecutor(plan, dataset, **options)
    elif name == "dali":
        ex = DaliExecutor(plan, dataset, **options)
    elif name == "module":
        ex = TorchExecutor(plan, dataset)
    else:
        raise ValueError(f"make_executor: unknown executor {name!r}; choose one of {list(EXECUTORS)}")
    log.info("preprocessing executor %s for plan %s", name, plan.name)
    return ex
