"""Where a model may be loaded from: only the registry (or a run) of the configured MLflow store.

Loading a registered TorchRec model unpickles it (mlflow.pytorch, serialization_format="pickle"; a pyfunc unpickles
its python_model), so a model URI is trusted only when it names this store's registry or one of its runs:
`models:/<name>/<version>`, `models:/<name>@<alias>`, a logged model `models:/m-<id>` or `runs:/<run id>/<path>` of
this store; a version must be registered from a run of this store, its source being that run's logged model or
artifact. A URI with another
registry or tracking server (`models://profile@host/...`), a file path or any other URL is refused, naming it.
What is loaded is the artifact location the store's client resolved, so the loader never resolves a URI through
MLflow's process-wide registry settings. Design: docs/security.md.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

from recforge.tracking.store import TrackingStore

T = TypeVar("T")

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
_VERSION_OR_ALIAS = re.compile(r"^(?:\d+|latest|[A-Za-z][A-Za-z0-9_\-]*)$")
_MODELS_URI = re.compile(rf"^models:/(?P<name>{_NAME})(?:/(?P<version>\d+|latest)|@(?P<alias>[A-Za-z][\w\-]*))$")
_LOGGED_URI = re.compile(r"^models:/(?P<id>m-[0-9a-f]+)$")
_RUNS_URI = re.compile(r"^runs:/(?P<run>[0-9a-f]{32})(?:/(?P<path>[^?#]*))?$")


class UntrustedModelError(ValueError):
    """A model URI or registered version that is not of the configured store: never loaded (it would be unpickled)."""


def registry_uri(store: TrackingStore) -> str:
    """The registry the store's client uses: MLFLOW_REGISTRY_URI when set at its creation, else the tracking URI."""
    return str(getattr(store.client, "_registry_uri", None) or store.tracking_uri)


def model_ref(name: str, version_or_alias: str | int | None) -> str:
    """`models:/name/version` or `models:/name@alias` (None: the newest version); a malformed part is refused."""
    ref = "latest" if version_or_alias is None else str(version_or_alias)
    if not re.fullmatch(_NAME, name) or not _VERSION_OR_ALIAS.match(ref):
        raise UntrustedModelError(f"model {name!r} version or alias {ref!r} is not a registered model reference "
                                  f"(a version number, 'latest' or an alias)")
    return f"models:/{name}/{ref}" if ref.isdigit() or ref == "latest" else f"models:/{name}@{ref}"


def trusted_location(store: TrackingStore, uri: str) -> str:
    """Where the model `uri` names lies (an artifact location of this store, resolved by its client); an alias or
    'latest' is resolved to its version first, so the checked version is the loaded one. Raises UntrustedModelError
    naming the URI and why; a version the registry does not have is MlflowException (not found)."""
    client = store.client
    m = _LOGGED_URI.match(uri)
    if m is not None:
        problem = _logged_problem(store, m["id"], None)
        if problem is not None:
            raise UntrustedModelError(f"refusing model {uri!r}: {problem}")
        return str(client.get_logged_model(m["id"]).artifact_location)
    m = _MODELS_URI.match(uri)
    if m is not None:
        mv = _version(store, m["name"], m["version"], m["alias"], uri)
        problem = _version_problem(store, mv)
        if problem is not None:
            raise UntrustedModelError(f"refusing model {uri!r} (version {mv.version}): {problem}")
        return str(client.get_model_version_download_uri(m["name"], str(mv.version)))
    m = _RUNS_URI.match(uri)
    if m is not None:
        path = (m["path"] or "").strip("/")
        if ".." in path.split("/"):
            raise UntrustedModelError(f"refusing model {uri!r}: its path leaves the run's artifacts")
        try:
            run = client.get_run(m["run"])
        except MlflowException as e:
            raise UntrustedModelError(f"refusing model {uri!r}: {m['run']} is not a run of the configured store "
                                      f"{store.tracking_uri} ({e.message[:200]})") from e
        return f"{str(run.info.artifact_uri).rstrip('/')}/{path}" if path else str(run.info.artifact_uri)
    if uri.startswith(("models:", "runs:")):
        why = "it names another registry or tracking server, or is malformed"
    else:
        why = "it is a path or URL, not a model of the configured store's registry"
    raise UntrustedModelError(f"refusing model {uri!r}: {why}; load models:/<name>/<version>, models:/<name>@<alias> "
                              f"or runs:/<run id>/<path> of {store.tracking_uri}")


def load_trusted(store: TrackingStore, uri: str, loader: Callable[[str], T]) -> T:
    """`loader(location)` (an MLflow flavour's load_model) once `trusted_location` accepted
    `uri`. The tracking URI is set to the store's (an `mlflow-artifacts:` location resolves through it)."""
    location = trusted_location(store, uri)
    mlflow.set_tracking_uri(store.tracking_uri)
    return loader(location)


def _version(store: TrackingStore, name: str, version: str | None, alias: str | None, uri: str) -> Any:
    """The registered version `uri` names; MlflowException (not found) when the registry has none."""
    client = store.client
    if alias is not None:
        return client.get_model_version_by_alias(name, alias)
    if version == "latest":
        versions = client.search_model_versions(f"name = '{name}'")
        if not versions:
            raise MlflowException(f"model {uri!r}: {name} has no version in the registry {registry_uri(store)}",
                                  error_code=RESOURCE_DOES_NOT_EXIST)
        return max(versions, key=lambda v: int(v.version))
    return client.get_model_version(name, str(version))


def _logged_problem(store: TrackingStore, model_id: str, run_id: str | None) -> str | None:
    """Why logged model `model_id` is not one of this store's runs (`run_id`: the run it must come from)."""
    try:
        model = store.client.get_logged_model(model_id)
    except MlflowException:
        return f"models:/{model_id} is not a logged model of the configured store {store.tracking_uri}"
    if run_id is not None and model.source_run_id != run_id:
        return f"its source models:/{model_id} was logged by run {model.source_run_id}, not by its run {run_id}"
    if run_id is None:
        if not model.source_run_id:
            return f"models:/{model_id} was logged by no run of this store"
        try:
            store.client.get_run(model.source_run_id)
        except MlflowException:
            return f"models:/{model_id} was logged by run {model.source_run_id}, not a run of this store"
    return None


def _version_problem(store: TrackingStore, mv: Any) -> str | None:
    """Why a registered version is not a model of this store (None: it is)."""
    run_id = mv.run_id
    if not run_id:
        return "it names no run of this store"
    try:
        run = store.client.get_run(run_id)
    except MlflowException:
        return f"its run {run_id} is not in the configured store {store.tracking_uri}"
    source = str(mv.source or "")
    logged = _LOGGED_URI.match(source)
    if logged is not None:
        return _logged_problem(store, logged["id"], run_id)
    if source.startswith(f"runs:/{run_id}/"):
        return None
    artifacts = str(run.info.artifact_uri or "").rstrip("/")
    if artifacts and source.startswith(artifacts + "/") and ".." not in source.split("/"):
        return None
    return f"its source {source!r} is not an artifact of its run {run_id}"

