"""Experiments and runs: one experiment per pipeline, a parent run per DAG run, a child run per stage.

Runs are found again by tags, never created twice for the same (run key, stage): an Airflow retry of a
task reuses its run, so MLflow holds exactly one run per stage of each DAG run. A failed run is FAILED with
its reason in the `recforge.error` tag (and `recforge.error_kind`); a retry reopens it and clears both.
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
from recforge.tracking.outage import PatientClient, bound_mlflow_request_retries

RUN_KEY_TAG = "recforge.run_key"
STAGE_TAG = "recforge.stage"
PARENT_TAG = "mlflow.parentRunId"
PARENT_STAGE = "pipeline"
ERROR_TAG = "recforge.error"  # why a FAILED run failed: the exception's first lines
ERROR_KIND_TAG = "recforge.error_kind"  # invalid_input (no retry) | error (retried while attempts remain) | cancelled
FAILED_STAGE_TAG = "recforge.failed_stage"  # on the parent run: the stage whose failure failed it
RETRY_TAG = "recforge.retrying"  # on a FAILED run whose Airflow task will be retried: "attempt 1 of 2 failed; ..."
# MLflow 3's UI opens an experiment by its kind; without the tag it guesses GenAI and shows traces, not runs
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
ERROR_MAX_LINES, ERROR_MAX_CHARS = 20, 4000


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
        bound_mlflow_request_retries()
        # every call waits out an unreachable server for a bounded time, then fails naming it (tracking/outage.py)
        self.client: Any = PatientClient(MlflowClient(tracking_uri=self.tracking_uri), self.tracking_uri)

    # experiments -------------------------------------------------------------------------------
    def experiment_id(self, name: str) -> str:
        """The experiment's id, created with the kind tag on first use (the tag is added to one that lacks it;
        a kind a user chose in the UI is kept)."""
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if EXPERIMENT_KIND_TAG not in exp.tags:
                self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return exp.experiment_id
        self.artifact_root.mkdir(parents=True, exist_ok=True)
        location = (self.artifact_root / name).resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location,
                                             tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})

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
        """The child run of one stage; a retried task gets the same run back, reopened (and a FAILED parent with
        it: the pipeline runs again)."""
        exp_id = self.experiment_id(experiment)
        parent = self.pipeline_run(experiment, run_key)
        if self.client.get_run(parent).info.status == "FAILED":
            self.reopen(parent)
        found = self._find(exp_id, run_key, stage)
        if found:
            self.reopen(found.info.run_id)
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

    def finish(self, run_id: str, ok: bool = True, error: BaseException | str | None = None,
               kind: str = "error") -> None:
        """FINISHED, or FAILED with `error` (an exception or a message) in ERROR_TAG and `kind` in ERROR_KIND_TAG."""
        if not ok:
            self.client.set_tag(run_id, ERROR_TAG, error_text(error) if error is not None else "failed")
            self.client.set_tag(run_id, ERROR_KIND_TAG, kind)
            if RETRY_TAG in self.client.get_run(run_id).data.tags:  # an earlier attempt's; mark_retrying sets anew
                self.client.delete_tag(run_id, RETRY_TAG)
        self.client.set_terminated(run_id, status="FINISHED" if ok else "FAILED")

    def reopen(self, run_id: str) -> None:
        """RUNNING again (a retry), without the error tags of the attempt before."""
        run = self.client.get_run(run_id)
        if run.info.status != RunStatus.to_string(RunStatus.RUNNING):
            self.client.update_run(run_id, status="RUNNING")
        for tag in (ERROR_TAG, ERROR_KIND_TAG, FAILED_STAGE_TAG, RETRY_TAG):
            if tag in run.data.tags:
                self.client.delete_tag(run_id, tag)

    def fail_pipeline(self, experiment: str, run_key: str, stage: str, error: BaseException | str,
                      kind: str = "error") -> str:
        """The parent run FAILED because `stage` failed, with the stage and its error."""
        parent = self.pipeline_run(experiment, run_key)
        self.client.set_tag(parent, FAILED_STAGE_TAG, stage)
        self.finish(parent, ok=False, error=f"stage {stage} failed: {error_text(error)}", kind=kind)
        return parent

    def mark_retrying(self, experiment: str, run_key: str, stage: str, note: str) -> None:
        """RETRY_TAG on the failed stage's run and the parent: this failure is not final, Airflow retries the task
        (the retry's reopen clears it)."""
        runs = self.stage_runs(experiment, run_key)
        for name in (stage, PARENT_STAGE):
            if name in runs:
                self.client.set_tag(runs[name].info.run_id, RETRY_TAG, note)

    def fail_open_runs(self, experiment: str, run_key: str, reason: str, kind: str = "error") -> list[str]:
        """Close every run of `run_key` still RUNNING as FAILED with `reason` (a task process killed before it could
        close its own run; the parent names the stage that was open); the ids closed. Closed runs are kept as
        they are."""
        running = RunStatus.to_string(RunStatus.RUNNING)
        runs = self.stage_runs(experiment, run_key)
        open_stages = sorted(s for s, r in runs.items() if s != PARENT_STAGE and r.info.status == running)
        closed = []
        for stage in open_stages:
            self.finish(runs[stage].info.run_id, ok=False, error=reason, kind=kind)
            closed.append(runs[stage].info.run_id)
        parent = runs.get(PARENT_STAGE)
        if parent is not None and parent.info.status == running:
            if open_stages:
                self.client.set_tag(parent.info.run_id, FAILED_STAGE_TAG, open_stages[0])
            where = f"stage {', '.join(open_stages)}: " if open_stages else ""
            self.finish(parent.info.run_id, ok=False, error=where + reason, kind=kind)
            closed.append(parent.info.run_id)
        return closed

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


def error_text(error: BaseException | str) -> str:
    """`Type: message`, its first ERROR_MAX_LINES lines and at most ERROR_MAX_CHARS characters (a tag's value)."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}".rstrip(": ")
    lines = text.strip().splitlines() or [type(error).__name__ if not isinstance(error, str) else "failed"]
    out = "\n".join(lines[:ERROR_MAX_LINES]) + ("\n..." if len(lines) > ERROR_MAX_LINES else "")
    return out if len(out) <= ERROR_MAX_CHARS else out[:ERROR_MAX_CHARS - 3] + "..."


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
