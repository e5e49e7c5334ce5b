"""Fitted resource-performance models in MLflow: log one per job, find them again as history.

Model-agnostic: a job's record is plain JSON-able data (`ResourceModelRecord`: the final plan, the
models' state, measurements), and the pyfunc's predictor comes from a loader the caller passes in
(recforge.elastic.optimizer.models.resource_store holds DLRover-RM's). `log_resource_model` puts into a run:
  - an MLflow model `resource_model` (pyfunc over the record; `load_resource_model(uri)` or
    mlflow.pyfunc.load_model);
  - `resource_model/record.json`: the record;
  - metrics `resource_model.<name>`, tags the history search uses, and a figure if one is given.
`find_resource_runs` returns the tagged runs of a dataset and model family, newest first; a run whose
record is missing or corrupt still gives its final plan (tag) and says what is wrong.
"""
from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from recforge.tracking.model_source import load_trusted, model_ref
from recforge.tracking.pyfunc import ArtifactPyfunc, Loader
from recforge.tracking.requirements import pinned_requirements
from recforge.tracking.store import TrackingStore

MODEL_TAG = "recforge.resource_model"
DATASET_TAG = "recforge.dataset"
FAMILY_TAG = "recforge.model_family"
PLAN_TAG = "recforge.final_plan"
RECORD_FILE = "resource_model/record.json"
EVENTS_FILE = "resource_model/events.jsonl"
FIGURE_FILE = "resource_model/predicted_vs_measured.png"
MODEL_NAME = "resource_model"
RECORD_KEY = "record"
REGISTRY_PREFIX = "recforge-resource-model"
# what a lookup raises when the store cannot be read: MLflow refusing or failing, the network or the disk under it
STORE_ERRORS: tuple[type[Exception], ...] = (MlflowException, OSError)


@dataclass
class ResourceModelRecord:
    """What one job leaves for the history, JSON-able: the models are their `to_dict()` state."""

    dataset: str
    model_family: str
    final_plan: dict[str, Any]
    throughput_model: dict[str, Any]
    memory_model: dict[str, Any] | None = None
    samples_per_s: float | None = None
    peak_memory_bytes: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StoredResourceRun:
    """A run tagged by `log_resource_model`: its final plan (from the tag) and its record as logged
    (None when it cannot be read); `problems` says what could not be read."""

    run_id: str
    final_plan: dict[str, Any]
    finished_at: float
    record: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)


def record_problem(run_id: str, error: BaseException) -> str:
    """The history's message for a run whose record cannot be used."""
    return (f"run {run_id}: {RECORD_FILE} missing or corrupt ({type(error).__name__}: {error}); "
            "using its final plan only")


def log_resource_model(store: TrackingStore, run_id: str, record: ResourceModelRecord, *, loader: Loader,
                       requirements: Sequence[str], metrics: dict[str, float] | None = None, figure: Any = None,
                       register: bool = False, version_tags: dict[str, str] | None = None) -> str:
    """Log a job's record as history and as a loadable pyfunc; returns the model URI.

    Args:
        loader: module-level ``loader(record path, model_config) -> predictor`` (stored by reference).
        requirements: the packages the predictor needs (pinned to the installed versions).
        metrics: logged as ``resource_model.<name>`` (NaN dropped).
        figure: a matplotlib figure logged as `FIGURE_FILE` (the caller closes it).
        register: also make the model a version of `registered_name(dataset, model_family)` (browsable in
            the MLflow UI's Models page; `load_resource_model(name=...)`), tagged `version_tags`.
    """
    data = record.to_dict()
    store.set_tags(run_id, {MODEL_TAG: "1", DATASET_TAG: record.dataset, FAMILY_TAG: record.model_family,
                            PLAN_TAG: json.dumps(record.final_plan, sort_keys=True)})
    store.log_metrics(run_id, {f"resource_model.{k}": v for k, v in (metrics or {}).items() if v == v})
    store.log_dict(run_id, data, RECORD_FILE)
    if figure is not None:
        store.log_figure(run_id, figure, FIGURE_FILE)
    mlflow.set_tracking_uri(store.tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "record.json"
        path.write_text(json.dumps(data, indent=2, default=str))
        with mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None), warnings.catch_warnings():
            # predict takes a DataFrame of any of the documented columns: no type-hint signature to infer
            warnings.filterwarnings("ignore", message=".*type hints.*")
            info = mlflow.pyfunc.log_model(name=MODEL_NAME, python_model=ArtifactPyfunc(loader, RECORD_KEY),
                                           artifacts={RECORD_KEY: str(path)},
                                           pip_requirements=pinned_requirements(requirements))
    if register:
        register_resource_model(store, run_id, info, registered_name(record.dataset, record.model_family),
                                tags=version_tags)
    return info.model_uri


def registered_name(dataset: str, model_family: str) -> str:
    """One registered model per dataset preset and model family: its versions are the daily jobs' fits."""
    return f"{REGISTRY_PREFIX}-{dataset}-{model_family}"


def registered_versions(store: TrackingStore, dataset: str, model_family: str) -> dict[str, str]:
    """{run id: "<registered name> v<N>"} for the versions of `registered_name(dataset, model_family)`
    (empty when nothing is registered)."""
    name = registered_name(dataset, model_family)
    try:
        versions = store.client.search_model_versions(f"name = '{_q(name)}'")
    except MlflowException:
        return {}
    return {v.run_id: f"{name} v{v.version}" for v in versions if v.run_id}


def latest_registered_record(store: TrackingStore, dataset: str, model_family: str) -> StoredResourceRun | None:
    """The record of the newest version of `registered_name(dataset, model_family)` (None: none registered)."""
    versions = registered_versions(store, dataset, model_family)
    if not versions:
        return None
    run_id, _ = max(versions.items(), key=lambda kv: int(kv[1].rsplit("v", 1)[1]))
    return _stored(store, store.client.get_run(run_id))


def register_resource_model(store: TrackingStore, run_id: str, info, name: str,
                            tags: dict[str, str] | None = None) -> str:
    """Register a logged resource model (idempotent per run: a retried task finds its version)."""
    client = store.client
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="recforge DLRover-RM resource-performance model: "
                                       "samples/s and memory per resource configuration")
    existing = client.search_model_versions(f"name = '{_q(name)}' and run_id = '{run_id}'")
    if existing:
        return str(max((v.version for v in existing), key=int))
    mv = client.create_model_version(name, source=info.model_uri, run_id=run_id, tags=tags or {},
                                     model_id=getattr(info, "model_id", None))
    return str(mv.version)


def log_events(store: TrackingStore, run_id: str, events: Sequence[Any], prefix: str = "dlrover") -> None:
    """Decisions (objects with `.stage` and `.to_dict()`, e.g. the optimizer's events) as JSON lines in
    one artifact, plus a count per stage."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(EVENTS_FILE).name
        path.write_text("".join(json.dumps(e.to_dict(), sort_keys=True) + "\n" for e in events))
        store.log_artifact(run_id, path, str(Path(EVENTS_FILE).parent))
    counts: dict[str, float] = {}
    for e in events:
        counts[f"{prefix}.events.{e.stage}"] = counts.get(f"{prefix}.events.{e.stage}", 0) + 1
    store.log_metrics(run_id, counts)


def load_resource_model(model_uri: str | None = None, tracking_uri: str | None = None, *, name: str | None = None,
                        version: str | int | None = None):
    """The pyfunc: `.predict(pd.DataFrame({"workers": [8], "cpu_per_worker": [2], "batch_size": [512]}))`.

    Either a model URI (runs:/..., models:/...) or a registered `name` (see `registered_name`) with a
    `version` (a number, an alias, or None for the newest version), of the store at `tracking_uri` (default: the
    configured one); anything else is refused (UntrustedModelError: the pyfunc is unpickled)."""
    if (model_uri is None) == (name is None):
        raise ValueError("load_resource_model: give either model_uri or name (with an optional version)")
    store = TrackingStore(tracking_uri)
    if name is not None:
        model_uri = model_ref(name, version)
    assert model_uri is not None
    try:
        return load_trusted(store, model_uri, mlflow.pyfunc.load_model)
    except MlflowException as e:
        raise MlflowException(f"resource model {model_uri!r} cannot be loaded: {e.message}") from e


def find_resource_runs(store: TrackingStore, dataset: str, model_family: str,
                       limit: int = 20) -> list[StoredResourceRun]:
    """Runs tagged by `log_resource_model` for `dataset` and `model_family` (any experiment), newest first."""
    client = store.client
    exps = [e.experiment_id for e in client.search_experiments()]
    if not exps:
        return []
    runs = client.search_runs(
        exps, filter_string=(f"tags.`{MODEL_TAG}` = '1' and tags.`{DATASET_TAG}` = '{_q(dataset)}' "
                             f"and tags.`{FAMILY_TAG}` = '{_q(model_family)}'"),
        order_by=["attributes.start_time DESC"], max_results=limit)
    return [_stored(store, r) for r in runs]


def _stored(store: TrackingStore, run) -> StoredResourceRun:
    run_id = run.info.run_id
    out = StoredResourceRun(run_id, {}, (run.info.end_time or run.info.start_time or 0) / 1000.0, None)
    try:
        out.final_plan = json.loads(run.data.tags.get(PLAN_TAG, "{}"))
    except json.JSONDecodeError:
        out.problems.append(f"run {run_id}: tag {PLAN_TAG} is not JSON")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = store.client.download_artifacts(run_id, RECORD_FILE, tmp)
            out.record = json.loads(Path(path).read_text())
    except (MlflowException, OSError, json.JSONDecodeError) as e:
        out.problems.append(record_problem(run_id, e))
    return out


def _q(s: str) -> str:
    return s.replace("'", "\\'")
