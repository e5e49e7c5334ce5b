"""MLflow for recforge: runs per pipeline stage, metrics, the model registry, stored models; the only package that
imports mlflow."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recforge.tracking.metrics import log_metrics
    from recforge.tracking.registry import ModelRegistry, PromotionDecision
    from recforge.tracking.store import TrackingStore, default_artifact_root, default_tracking_uri

# Names resolve on first use: `import recforge.tracking` stays cheap (mlflow takes seconds to import).
_EXPORTS = {
    "TrackingStore": "recforge.tracking.store", "default_tracking_uri": "recforge.tracking.store",
    "default_artifact_root": "recforge.tracking.store", "log_metrics": "recforge.tracking.metrics",
    "ModelRegistry": "recforge.tracking.registry", "PromotionDecision": "recforge.tracking.registry",
}

__all__ = [
    "TrackingStore", "default_tracking_uri", "default_artifact_root", "log_metrics",
    "ModelRegistry", "PromotionDecision",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
