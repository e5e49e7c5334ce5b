"""Model registry: log a trained model, register it, move the `champion` alias behind a quality gate."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from recforge.tracking.requirements import pinned_requirements
from recforge.tracking.store import TrackingStore

CHAMPION = "champion"
QUALITY_TAG = "auc"


@dataclass(frozen=True)
class PromotionDecision:
    version: str
    promoted: bool
    auc: float
    champion_version: str | None
    champion_auc: float | None
    margin: float
    reason: str


class ModelRegistry:
    def __init__(self, store: TrackingStore, name: str = "recforge-dlrm"):
        self.store = store
        self.client = store.client
        self.name = name

    def version_for_run(self, run_id: str) -> str | None:
        versions = self.client.search_model_versions(f"name = '{self.name}' and run_id = '{run_id}'")
        return str(max((v.version for v in versions), key=int)) if versions else None

    def log_and_register(self, run_id: str, model: Any, *, auc: float, tags: dict[str, str] | None = None) -> str:
        """Log `model` (pickled: TorchRec modules do not export to pt2) under `run_id` and register it.

        Idempotent: a retry of the same run finds its version instead of registering a second one.
        """
        existing = self.version_for_run(run_id)
        if existing is not None:
            return existing
        mlflow.set_tracking_uri(self.store.tracking_uri)
        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(self.name, description="recforge DLRM (TorchRec), trained daily")
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pytorch.log_model(
                model, name="model", serialization_format="pickle", pip_requirements=_pinned_requirements()
            )
        mv = self.client.create_model_version(
            self.name, source=info.model_uri, run_id=run_id,
            tags={QUALITY_TAG: f"{auc:.6f}", **(tags or {})}, model_id=info.model_id,
        )
        return str(mv.version)

    def champion(self):
        try:
            return self.client.get_model_version_by_alias(self.name, CHAMPION)
        except MlflowException:
            return None

    def promote_if_not_worse(self, version: str, auc: float, margin: float) -> PromotionDecision:
        current = self.champion()
        version = str(version)
        champ_auc: float | None
        if current is not None and str(current.version) == version:
            champ_auc = float(current.tags.get(QUALITY_TAG, "nan"))
            return PromotionDecision(version, True, auc, version, champ_auc, margin, "already champion")
        if current is None:
            promote, champ_auc, reason = True, None, "no champion yet"
        else:
            champ_auc = float(current.tags.get(QUALITY_TAG, "-inf"))
            promote = auc >= champ_auc - margin
            verdict = "within" if promote else "below"
            reason = f"AUC {auc:.4f} vs champion v{current.version} {champ_auc:.4f}: {verdict} margin {margin}"
        if promote:
            self.client.set_registered_model_alias(self.name, CHAMPION, version)
        self.client.set_model_version_tag(self.name, version, "promotion", reason)
        return PromotionDecision(
            version, promote, auc, str(current.version) if current else None, champ_auc, margin, reason
        )

    def load(self, version_or_alias: str):
        """Load a registered model. Pickled artifacts are only ever loaded from this registry."""
        version_or_alias = str(version_or_alias)
        ref = f"/{version_or_alias}" if version_or_alias.isdigit() else f"@{version_or_alias}"
        mlflow.set_tracking_uri(self.store.tracking_uri)
        return mlflow.pytorch.load_model(f"models:/{self.name}{ref}")


def _pinned_requirements() -> list[str]:
    """The serving environment, pinned; MLflow's own inference of it takes seconds per model."""
    return pinned_requirements(("torch", "torchrec", "fbgemm-gpu-cpu", "numpy"))
