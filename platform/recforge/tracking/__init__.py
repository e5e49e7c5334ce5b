"""The only module that talks to MLflow. Everything else calls these functions."""
from recforge.tracking.store import TrackingStore, default_tracking_uri, default_artifact_root
from recforge.tracking.metrics import log_metrics
from recforge.tracking.registry import ModelRegistry, PromotionDecision

__all__ = [
    "TrackingStore", "default_tracking_uri", "default_artifact_root", "log_metrics",
    "ModelRegistry", "PromotionDecision",
]
