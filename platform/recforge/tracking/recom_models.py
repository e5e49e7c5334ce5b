"""Compiled inference models in MLflow: a pyfunc holding the compiled file, registered next to the
trained model (registered name ``<trained name>-compiled``).

The caller passes the loader that turns the file into a predictor (recforge.recom.serving for RECom's
compiled models); ``model_config`` given at load time reaches that loader (RECom: ``{"backend":
"export"}`` skips AOTInductor's recompilation).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from recforge.tracking.model_source import load_trusted, model_ref
from recforge.tracking.pyfunc import ArtifactPyfunc, Loader
from recforge.tracking.requirements import pinned_requirements
from recforge.tracking.store import TrackingStore

ARTIFACT_KEY = "compiled"
COMPILED_SUFFIX = "-compiled"


def compiled_name(trained_name: str) -> str:
    """The registered name of the compiled model of ``trained_name``."""
    return trained_name + COMPILED_SUFFIX


def register_compiled(store: TrackingStore, run_id: str, compiled_path: str | Path, trained_name: str, *,
                      loader: Loader, requirements: Sequence[str], max_abs_diff: float, atol: float,
                      description: str = "", tags: dict[str, str] | None = None) -> str:
    """Log ``compiled_path`` as a pyfunc under ``run_id`` and register it as ``<trained_name>-compiled``.

    Args:
        loader: module-level ``loader(path, model_config) -> predictor`` (stored by reference).
        requirements: the packages the predictor needs (pinned to the installed versions).
        max_abs_diff, atol: only a model that matched eager may be registered: ``max_abs_diff`` must be
            <= ``atol`` (ValueError otherwise).

    Returns the version; idempotent per run: a retried task gets its existing version back.
    """
    if not max_abs_diff <= atol:
        raise ValueError(f"compiled model differs from eager by {max_abs_diff:.3g} > {atol:g}: not registering it")
    name = compiled_name(trained_name)
    client = store.client
    existing = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    if existing:
        return str(max((v.version for v in existing), key=int))
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=description or f"compiled inference of {trained_name}")
    mlflow.set_tracking_uri(store.tracking_uri)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name="compiled_model", python_model=ArtifactPyfunc(loader, ARTIFACT_KEY),
            artifacts={ARTIFACT_KEY: str(compiled_path)}, pip_requirements=pinned_requirements(requirements),
        )
    mv = client.create_model_version(
        name, source=info.model_uri, run_id=run_id, model_id=info.model_id,
        tags={"max_abs_diff": f"{max_abs_diff:.3g}", "atol": f"{atol:g}", "trained_model": trained_name,
              **(tags or {})},
    )
    return str(mv.version)


def load_compiled(store: TrackingStore, trained_name: str, version_or_alias: str,
                  backend: str | None = "export") -> Any:
    """The registered pyfunc (``mlflow.pyfunc.PyFuncModel``) of a compiled model version or alias;
    ``backend`` reaches the loader as ``model_config["backend"]``."""
    config = {"backend": backend} if backend else None
    # unpickled (the pyfunc's python_model): only from this store's registry (recforge.tracking.model_source)
    return load_trusted(store, model_ref(compiled_name(trained_name), str(version_or_alias)),
                        lambda uri: mlflow.pyfunc.load_model(uri, model_config=config))
