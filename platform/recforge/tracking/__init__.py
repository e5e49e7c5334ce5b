"""MLflow for recforge: runs per pipeline stage, metrics, the model registry, stored models; the only package that
imports mlflow."""
from __future__ import annotations

from typing import TYPE_CHECKING

from recforge.exports import lazy_exports

if TYPE_CHECKING:
    from recforge.tracking.metrics import log_metrics as log_metrics
    from recforge.tracking.registry import ModelRegistry as ModelRegistry
    from recforge.tracking.registry import PromotionDecision as PromotionDecision
    from recforge.tracking.store import TrackingStore as TrackingStore
    from recforge.tracking.store import default_artifact_root as default_artifact_root
    from recforge.tracking.store import default_tracking_uri as default_tracking_uri

# Names resolve on first use: `import recforge.tracking` stays cheap (mlflow takes seconds to import).
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.tracking.store": ("TrackingStore", "default_artifact_root", "default_tracking_uri"),
    "recforge.tracking.metrics": ("log_metrics",),
    "recforge.tracking.registry": ("ModelRegistry", "PromotionDecision"),
})
