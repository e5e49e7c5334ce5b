"""RAP preprocessing: plans and their compiler (planning), the op vocabulary (semantics), preset plans (presets),
raw batches (batch), the exportable PreprocessModule (module) and the Executor seam (executor, executors).

The plan side imports eagerly; the torch side (RawBatch, Executor, make_executor, ...) resolves on first use, so
the plan stage, the UI and the CLI import this package without loading torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from recforge.preprocess.planning import CompiledPlan, FeaturePlan, OpSpec, Plan, PlanError, compile_plan, criteo_plan
from recforge.preprocess.presets import load_plan
from recforge.preprocess.run_params import preprocess_params
from recforge.preprocess.semantics import OPS, OpError

if TYPE_CHECKING:
    from recforge.preprocess.batch import RawBatch
    from recforge.preprocess.columns import BatchError
    from recforge.preprocess.executor import EXECUTORS, Executor, TorchExecutor, make_executor
    from recforge.preprocess.module import PreprocessModule

_TORCH_EXPORTS = {
    "RawBatch": "recforge.preprocess.batch", "BatchError": "recforge.preprocess.columns",
    "EXECUTORS": "recforge.preprocess.executor", "Executor": "recforge.preprocess.executor",
    "TorchExecutor": "recforge.preprocess.executor", "make_executor": "recforge.preprocess.executor",
    "PreprocessModule": "recforge.preprocess.module",
}

__all__ = [
    "EXECUTORS", "OPS", "BatchError", "CompiledPlan", "Executor", "FeaturePlan", "OpError", "OpSpec", "Plan",
    "PlanError", "PreprocessModule", "RawBatch", "TorchExecutor", "compile_plan", "criteo_plan", "load_plan",
    "make_executor", "preprocess_params",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_EXPORTS:
        return getattr(importlib.import_module(_TORCH_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
