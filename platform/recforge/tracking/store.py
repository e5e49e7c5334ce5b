"""Experiments and runs: one experiment per pipeline, a parent run per DAG run, a child run per stage.

Runs are found again by tags, never created twice for the same (run key, stage): an Airflow retry of a
task reuses its run, so MLflow holds exactly one run per stage of each DAG run.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import RunStatus

from recforge.settings import recforge_home
from recforge.tracking.metrics import log_metric_batch

RUN_KEY_TAG = "recforge.run_key"
STAGE_TAG = "recforge.stage"
PARENT_TAG = "mlflow.parentRunId"
PARENT_STAGE = "pipeline"


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{recforge_home() / 'mlflow' / 'mlflow.db'}"


def default_artifact_root() -> Path:
    env = os.environ.get("RECFORGE_MLFLOW_ARTIFACTS")
    return Path(env) if env else recforge_home() / "mlflow" / "artifacts"


class TrackingStore:
    def __init__(self, tracking_uri: str | None = None, artifact_root: str | Path | None = None):
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.artifact_root = Path(artifact_root) if artifact_root else default_artifact_root()
        if self.tracking_uri.startswith("sqlite:///"):
            Path(self.tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)

    # experiments -------------------------------------------------------------------------------
    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        self.artifact_root.mkdir(parents=True, exist_ok=True)
        location = (self.artifact_root / name).resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    # runs ----------------------------------------------------------------------------------------
    def _find(self, experiment_id: str, run_key: str, stage: str):
        runs = self.client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}' and tags.`{STAGE_TAG}` = '{stage}'",
            max_results=2,
        )
        return runs[0] if runs else None

    def pipeline_run(self, experiment: str, run_key: str, tags: dict[str, str] | None = None) -> str:
        """The parent run of one DAG run (created once, found again afterwards)."""
        exp_id = self.experiment_id(experiment)
        found = self._find(exp_id, run_key, PARENT_STAGE)
        if found:
            return found.info.run_id
        run = self.client.create_run(
            exp_id, run_name=run_key, tags={RUN_KEY_TAG: run_key, STAGE_TAG: PARENT_STAGE, **(tags or {})}
        )
        return run.info.run_id

    def stage_run(self, experiment: str, run_key: str, stage: str) -> str:
        """The child run of one stage; a retried task gets the same run back, reopened."""
        exp_id = self.experiment_id(experiment)
        parent = self.pipeline_run(experiment, run_key)
        found = self._find(exp_id, run_key, stage)
        if found:
            if found.info.status != RunStatus.to_string(RunStatus.RUNNING):
                self.client.update_run(found.info.run_id, status="RUNNING")
            return found.info.run_id
        run = self.client.create_run(
            exp_id, run_name=stage, tags={RUN_KEY_TAG: run_key, STAGE_TAG: stage, PARENT_TAG: parent}
        )
        return run.info.run_id

    def stage_runs(self, experiment: str, run_key: str) -> dict[str, Any]:
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            return {}
        runs = self.client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'")
        return {r.data.tags[STAGE_TAG]: r for r in runs}

    def finish(self, run_id: str, ok: bool = True) -> None:
        self.client.set_terminated(run_id, status="FINISHED" if ok else "FAILED")

    # logging -------------------------------------------------------------------------------------
    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        """Params are immutable in MLflow: a retry logs the same values again, which is allowed."""
        flat = _flatten(params)
        existing = self.client.get_run(run_id).data.params
        for key, value in flat.items():
            value = str(value)[:6000]
            if key in existing:
                if existing[key] != value:
                    raise ValueError(f"param {key!r} of run {run_id} was {existing[key]!r}, now {value!r}")
                continue
            self.client.log_param(run_id, key, value)

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        log_metric_batch(self.client, run_id, metrics, step)

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_tag(run_id, k, str(v))

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def log_dict(self, run_id: str, data: Any, artifact_file: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            target = Path(tmp) / Path(artifact_file).name
            target.write_text(json.dumps(data, indent=2, default=str))
            parent = str(Path(artifact_file).parent)
            self.client.log_artifact(run_id, str(target), None if parent == "." else parent)

    def log_figure(self, run_id: str, figure, artifact_file: str) -> None:
        self.client.log_figure(run_id, figure, artifact_file)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
