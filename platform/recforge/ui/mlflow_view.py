"""What the page reads from MLflow, through recforge.tracking (the only module that imports mlflow).

Every read is best effort: a store that cannot be reached, or a run or artifact that is not there, becomes a
line in `problems` and an empty answer, so the page still shows what the stages recorded on disk.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from recforge.pipelines.context import EXPERIMENT
from recforge.tracking.store import PARENT_STAGE, RUN_KEY_TAG, STAGE_TAG, TrackingStore

MAX_ARTIFACT_BYTES = 4 << 20
# what recforge.tracking.resource_models logs for the DLRover-RM stages
EVENTS_ARTIFACT = "resource_model/events.jsonl"
RECORD_ARTIFACT = "resource_model/record.json"
PLOT_ARTIFACT = "resource_model/predicted_vs_measured.png"
MAX_CURVE_POINTS = 500


@dataclass
class MlflowRun:
    run_id: str
    experiment_id: str
    status: str
    start_time: int | None
    end_time: int | None
    artifact_uri: str | None = None
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, run) -> MlflowRun:
        return cls(run.info.run_id, run.info.experiment_id, run.info.status, run.info.start_time,
                   run.info.end_time, run.info.artifact_uri, dict(run.data.params), dict(run.data.metrics),
                   {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")})


class MlflowView:
    def __init__(self, tracking_uri: str | None = None, experiment: str = EXPERIMENT):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.problems: list[str] = []
        self._store = None
        self._experiment_id: str | None = None
        self._listed: dict[str, set[str]] = {}

    def _note(self, what: str, error: BaseException) -> None:
        self.problems.append(f"{what}: {type(error).__name__}: {str(error)[:300]}")

    @property
    def store(self):
        if self._store is None:
            self._store = TrackingStore(self.tracking_uri)
        return self._store

    def experiment_id(self) -> str | None:
        if self._experiment_id is None:
            try:
                exp = self.store.client.get_experiment_by_name(self.experiment)
                self._experiment_id = exp.experiment_id if exp is not None else None
            except Exception as e:  # any store failure is shown, not raised
                self._note("MLflow experiment", e)
        return self._experiment_id

    def pipeline_runs(self) -> dict[str, MlflowRun]:
        """run key -> parent run, for every pipeline run of the experiment (one search)."""
        exp = self.experiment_id()
        if exp is None:
            return {}
        try:
            runs = self.store.client.search_runs([exp], filter_string=f"tags.`{STAGE_TAG}` = '{PARENT_STAGE}'",
                                                 max_results=1000)
        except Exception as e:  # shown, not raised
            self._note("MLflow pipeline runs", e)
            return {}
        return {r.data.tags[RUN_KEY_TAG]: MlflowRun.of(r) for r in runs if RUN_KEY_TAG in r.data.tags}

    def unfinished_runs(self) -> dict[str, dict[str, MlflowRun]]:
        """run key -> stage (and "pipeline") -> run, for every run of the experiment not FINISHED (one search):
        what the runs list needs to tell a failed run from one in progress."""
        exp = self.experiment_id()
        if exp is None:
            return {}
        try:
            runs = self.store.client.search_runs([exp], filter_string="attributes.status != 'FINISHED'",
                                                 max_results=5000)
        except Exception as e:  # shown, not raised
            self._note("MLflow runs not finished", e)
            return {}
        out: dict[str, dict[str, MlflowRun]] = {}
        for r in runs:
            tags = r.data.tags
            if RUN_KEY_TAG in tags and STAGE_TAG in tags:
                out.setdefault(tags[RUN_KEY_TAG], {})[tags[STAGE_TAG]] = MlflowRun.of(r)
        return out

    def stage_runs(self, run_key: str) -> dict[str, MlflowRun]:
        """stage name (and "pipeline" for the parent) -> run."""
        try:
            return {stage: MlflowRun.of(r) for stage, r in self.store.stage_runs(self.experiment, run_key).items()}
        except Exception as e:  # shown, not raised
            self._note(f"MLflow runs of {run_key}", e)
            return {}

    def _top_level(self, run_id: str) -> set[str]:
        if run_id not in self._listed:
            self._listed[run_id] = {a.path for a in self.store.client.list_artifacts(run_id)}
        return self._listed[run_id]

    def _artifact(self, run: MlflowRun, path: str) -> bytes | None:
        """One artifact file of a run. A local artifact store (file://) is read from disk: MLflow 3 routes a
        client download under a directory named like a logged model (resource_model/) through that model's
        repository, which it opens with the process-wide tracking URI, not this store's."""
        try:
            if path.split("/")[0] not in self._top_level(run.run_id):
                return None
            parts = urlsplit(run.artifact_uri or "")
            if parts.scheme == "file":
                root = Path(unquote(parts.path)).resolve()
                local = (root / path).resolve()
                if not local.is_relative_to(root) or not local.is_file():
                    return None
                return self._bounded(local, run, path)
            with tempfile.TemporaryDirectory() as tmp:
                return self._bounded(Path(self.store.client.download_artifacts(run.run_id, path, tmp)), run, path)
        except Exception as e:  # shown, not raised
            if isinstance(e, FileNotFoundError) or "Failed to download artifacts from path" in str(e):
                return None  # the directory exists, this file in it does not
            self._note(f"artifact {path} of run {run.run_id}", e)
            return None

    def _bounded(self, local: Path, run: MlflowRun, path: str) -> bytes | None:
        size = local.stat().st_size
        if size > MAX_ARTIFACT_BYTES:
            self.problems.append(f"artifact {path} of run {run.run_id} is {size:,} bytes: not shown")
            return None
        return local.read_bytes()

    def artifact_png(self, run: MlflowRun, path: str) -> bytes | None:
        data = self._artifact(run, path)
        if data is not None and not data.startswith(b"\x89PNG\r\n\x1a\n"):
            self.problems.append(f"artifact {path} of run {run.run_id} is not a PNG: not shown")
            return None
        return data

    def artifact_json(self, run: MlflowRun, path: str) -> Any:
        data = self._artifact(run, path)
        if data is None:
            return None
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._note(f"artifact {path} of run {run.run_id}", e)
            return None

    def artifact_jsonl(self, run: MlflowRun, path: str) -> list[dict[str, Any]]:
        data = self._artifact(run, path)
        rows: list[dict[str, Any]] = []
        if data is None:
            return rows
        for i, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                self._note(f"artifact {path} of run {run.run_id}, line {i}", e)
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def events(self, run: MlflowRun) -> list[dict[str, Any]]:
        """DLRover-RM's events logged to a stage run (recforge.tracking.resource_models.log_events)."""
        return self.artifact_jsonl(run, EVENTS_ARTIFACT)

    def metric_history(self, run: MlflowRun, key: str, max_points: int = MAX_CURVE_POINTS) -> list[tuple[int, float]]:
        """(step, value) of one metric, one value per step (the latest logged: a resumed run may log a step
        again), at most `max_points` (evenly thinned, the last kept)."""
        if key not in run.metrics:
            return []
        try:
            history = self.store.client.get_metric_history(run.run_id, key)
        except Exception as e:  # shown, not raised
            self._note(f"metric {key} of run {run.run_id}", e)
            return []
        latest: dict[int, tuple[int, float]] = {}
        for m in history:
            if m.step not in latest or m.timestamp >= latest[m.step][0]:
                latest[m.step] = (m.timestamp, m.value)
        points = sorted((step, value) for step, (_, value) in latest.items())
        if len(points) > max_points:
            stride = len(points) / max_points
            points = [points[int(i * stride)] for i in range(max_points - 1)] + [points[-1]]
        return points

    def model_version(self, name: str, version: str) -> dict[str, Any] | None:
        try:
            mv = self.store.client.get_model_version(name, str(version))
        except Exception as e:  # shown, not raised
            self._note(f"model {name} v{version}", e)
            return None
        return {"name": mv.name, "version": str(mv.version), "status": mv.status, "run_id": mv.run_id,
                "aliases": list(mv.aliases or []), "tags": dict(mv.tags or {})}
