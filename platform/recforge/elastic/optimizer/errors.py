"""The errors the optimizer expects, and falls back on with a "fallback" event naming the cause. Any other
exception is a bug and propagates: an `except` in the optimizer names one of these tuples, never Exception."""
from __future__ import annotations

import numpy as np

from recforge.elastic.optimizer.models.throughput_model import ModelFitError
from recforge.elastic.optimizer.plans import ResourceLimitError

# A fit or a search on a degenerate model: too few or bad points, NNLS not converging (ModelFitError), a singular
# system (numpy's LinAlgError), scipy's input checks (ValueError), no plan inside the limits (ResourceLimitError).
MODEL_ERRORS: tuple[type[Exception], ...] = (ModelFitError, np.linalg.LinAlgError, ResourceLimitError, ValueError)

# A record or a stage 1 state that is not what it should be (history from MLflow, a task's JSON): a missing key, a
# value of the wrong type or out of range.
RECORD_ERRORS: tuple[type[Exception], ...] = (KeyError, TypeError, ValueError)


def describe(e: BaseException) -> str:
    """`Type: message`, for an event's reason."""
    return f"{type(e).__name__}: {e}"
