"""RAP preprocessing: plans and their compiler (planning), the op vocabulary (semantics), preset plans (presets),
raw batches (batch), the exportable PreprocessModule (module) and the Executor seam (executor, executors).

The plan side imports eagerly; the torch side (RawBatch, Executor, make_executor, ...) resolves on first use, so
the plan stage, the UI and the CLI import this package without loading torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from recforge.exports import lazy_exports
from recforge.preprocess.planning import CompiledPlan as CompiledPlan
from recforge.preprocess.planning import FeaturePlan as FeaturePlan
from recforge.preprocess.planning import OpSpec as OpSpec
from recforge.preprocess.planning import Plan as Plan
from recforge.preprocess.planning import PlanError as PlanError
from recforge.preprocess.planning import compile_plan as compile_plan
from recforge.preprocess.planning import criteo_plan as criteo_plan
from recforge.preprocess.presets import load_plan as load_plan
from recforge.preprocess.run_params import preprocess_params as preprocess_params
from recforge.preprocess.semantics import OPS as OPS
from recforge.preprocess.semantics import OpError as OpError

if TYPE_CHECKING:
    from recforge.preprocess.batch import RawBatch as RawBatch
    from recforge.preprocess.columns import BatchError as BatchError
    from recforge.preprocess.executor import EXECUTORS as EXECUTORS
    from recforge.preprocess.executor import Executor as Executor
    from recforge.preprocess.executor import TorchExecutor as TorchExecutor
    from recforge.preprocess.executor import make_executor as make_executor
    from recforge.preprocess.module import PreprocessModule as PreprocessModule

__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.preprocess.batch": ("RawBatch",),
    "recforge.preprocess.columns": ("BatchError",),
    "recforge.preprocess.executor": ("EXECUTORS", "Executor", "TorchExecutor", "make_executor"),
    "recforge.preprocess.module": ("PreprocessModule",),
}, eager=("OPS", "CompiledPlan", "FeaturePlan", "OpError", "OpSpec", "Plan", "PlanError", "compile_plan",
          "criteo_plan", "load_plan", "preprocess_params"))
