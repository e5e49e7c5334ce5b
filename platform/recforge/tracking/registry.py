"""Model registry: log a trained model, register it, move the `champion` alias behind a quality gate.

The gate (`gate`) is a pure function of the challenger's and the champion's scores on the same held-out day;
`ModelRegistry.promote` applies it. Design and limits: docs/champion_gate.md."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from recforge.tracking.model_source import load_trusted, model_ref
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


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reason: str


class ChampionChangedError(RuntimeError):
    """The champion moved between scoring it and applying the gate: the comparison is stale."""


def gate(auc: float, rows: int, *, champion_auc: float | None, champion_version: str | None = None,
         margin: float, min_auc: float, min_rows: int, champion_problem: str | None = None) -> GateDecision:
    """Promote the challenger (`auc` on `rows` held-out rows) over the champion scored on the same day?

    Needs a finite AUC, at least `min_rows` rows, AUC >= `min_auc`, and AUC >= champion AUC - `margin`. A champion
    that could not be scored (`champion_problem`, or a non-finite AUC) does not block: the absolute checks decide."""
    if not math.isfinite(auc):
        return GateDecision(False, f"challenger AUC {auc} is not finite: a NaN/inf model is never promoted")
    if rows < min_rows:
        return GateDecision(False, f"challenger evaluated on {rows} held-out rows < champion_min_rows {min_rows}")
    if auc < min_auc:
        return GateDecision(False, f"challenger AUC {auc:.4f} is below the floor champion_min_auc {min_auc}")
    if champion_version is None and champion_auc is None and champion_problem is None:
        return GateDecision(True, f"no champion yet; AUC {auc:.4f} >= floor {min_auc} on {rows} rows")
    name = f"champion v{champion_version}" if champion_version is not None else "champion"
    if champion_problem is not None or champion_auc is None or not math.isfinite(champion_auc):
        why = champion_problem or f"its AUC on this day is {champion_auc}"
        return GateDecision(True, f"{name} could not be scored ({why}): replaced, AUC {auc:.4f} >= floor "
                                  f"{min_auc} on {rows} rows")
    if auc >= champion_auc - margin:
        return GateDecision(True, f"AUC {auc:.4f} vs {name} {champion_auc:.4f} on the same day: within margin "
                                  f"{margin}")
    return GateDecision(False, f"AUC {auc:.4f} vs {name} {champion_auc:.4f} on the same day: below by more than "
                               f"margin {margin}")


@dataclass(frozen=True)
class ChampionRef:
    """The current champion: its version, the run that registered it, and the version's tags."""

    version: str
    run_id: str
    tags: dict[str, str]


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

    def champion_ref(self) -> ChampionRef | None:
        """The champion as a plain record (None: no champion yet)."""
        mv = self.champion()
        if mv is None:
            return None
        return ChampionRef(version=str(mv.version), run_id=str(mv.run_id), tags=dict(mv.tags or {}))

    def download(self, version: str, artifact_path: str, dst: str | Path) -> Path:
        """An artifact of the run that registered `version` (e.g. the plan it was trained on), copied under `dst`."""
        mv = self.client.get_model_version(self.name, str(version))
        if not mv.run_id:
            raise ValueError(f"{self.name} v{version} names no run, so it has no run artifacts ({artifact_path})")
        Path(dst).mkdir(parents=True, exist_ok=True)
        return Path(self.client.download_artifacts(mv.run_id, artifact_path, str(dst)))

    def promote(self, version: str, *, auc: float, rows: int, champion_version: str | None,
                champion_auc: float | None, margin: float, min_auc: float, min_rows: int,
                champion_problem: str | None = None) -> PromotionDecision:
        """Apply `gate` against the champion that was scored (`champion_version`, None: none) and move the alias.

        Raises ChampionChangedError when the champion is no longer the one scored. Idempotent: a version that is
        already the champion stays it."""
        version = str(version)
        current = self.champion()
        now = str(current.version) if current is not None else None
        if now == version:  # a retried publish: the decision that promoted it stands
            earlier = (current.tags or {}).get("promotion")
            reason = f"already champion ({earlier})" if earlier else "already champion"
            return PromotionDecision(version, True, auc, version, champion_auc, margin, reason)
        if now != (str(champion_version) if champion_version is not None else None):
            raise ChampionChangedError(f"the champion of {self.name} is now {now}, not the scored {champion_version}")
        decision = gate(auc, rows, champion_auc=champion_auc, champion_version=champion_version, margin=margin,
                        min_auc=min_auc, min_rows=min_rows, champion_problem=champion_problem)
        if decision.promote:
            self.client.set_registered_model_alias(self.name, CHAMPION, version)
        self.client.set_model_version_tag(self.name, version, "promotion", decision.reason)
        return PromotionDecision(version, decision.promote, auc, now, champion_auc, margin, decision.reason)

    def load(self, version_or_alias: str):
        """Load a registered model (unpickled): only a version of this store's registry registered from one of its
        runs (recforge.tracking.model_source; UntrustedModelError otherwise)."""
        return load_trusted(self.store, model_ref(self.name, str(version_or_alias)), mlflow.pytorch.load_model)


def _pinned_requirements() -> list[str]:
    """The serving environment, pinned; MLflow's own inference of it takes seconds per model."""
    return pinned_requirements(("torch", "torchrec", "fbgemm-gpu-cpu", "numpy"))
