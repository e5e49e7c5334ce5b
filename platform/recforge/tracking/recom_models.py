"""RECom-compiled models in MLflow: a pyfunc flavor holding the compiled file, registered next to the
trained model (registered name ``<trained name>-compiled``).

The pyfunc's one artifact is the file ``recforge.recom.save`` writes (residual dense program, packed
tables, compiled column plan, metadata). ``predict`` takes a dict of arrays keyed by the model's flat
input names (``CompiledModel.input_names``; for the DLRM: dense, dense_valid, sparse, sparse_valid) and
returns a numpy array. ``model_config={"backend": "export"}`` at load time skips AOTInductor's
recompilation (the default is the backend the model was compiled with).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from recforge.tracking.store import TrackingStore

ARTIFACT_KEY = "compiled"
COMPILED_SUFFIX = "-compiled"


class CompiledRecomModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper of a recforge.recom CompiledModel."""

    def load_context(self, context) -> None:
        import recforge.recom as recom

        backend = (context.model_config or {}).get("backend")
        self.model = recom.load(context.artifacts[ARTIFACT_KEY], backend=backend)

    def predict(self, context, model_input, params=None):
        import torch
        from torch.utils import _pytree as pytree

        model = self.model
        names = model.input_names
        if names is None or model.in_spec is None:
            raise ValueError("this compiled model does not record its input names; call it from Python instead")
        if not isinstance(model_input, dict):
            raise TypeError(f"model_input must be a dict of arrays keyed by {names}, got {type(model_input).__name__}")
        missing = [n for n in names if n not in model_input]
        if missing:
            raise KeyError(f"model_input lacks inputs {missing} (expected {names})")
        leaves = [torch.as_tensor(model_input[n]) for n in names]
        args = pytree.tree_unflatten(leaves, model.in_spec)
        return model(*args).detach().cpu().numpy()


def _requirements() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for pkg in ("torch", "torchrec", "fbgemm-gpu-cpu", "numpy", "symengine"):
        try:
            out.append(f"{pkg}=={version(pkg).split('+')[0]}")
        except PackageNotFoundError:
            pass
    return out


def compiled_name(trained_name: str) -> str:
    return trained_name + COMPILED_SUFFIX


def register_compiled(store: TrackingStore, run_id: str, compiled_path: str | Path, trained_name: str, *,
                      max_abs_diff: float, atol: float, tags: dict[str, str] | None = None) -> str:
    """Log ``compiled_path`` as a pyfunc under ``run_id`` and register it as ``<trained_name>-compiled``.

    Only a model that matched eager may be registered: ``max_abs_diff`` must be <= ``atol`` (ValueError
    otherwise). Idempotent per run: a retried task gets its existing version back.
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
        client.create_registered_model(name, description=f"RECom-compiled inference of {trained_name}")
    mlflow.set_tracking_uri(store.tracking_uri)
    with mlflow.start_run(run_id=run_id):
        info = mlflow.pyfunc.log_model(
            name="compiled_model", python_model=CompiledRecomModel(),
            artifacts={ARTIFACT_KEY: str(compiled_path)}, pip_requirements=_requirements(),
        )
    mv = client.create_model_version(
        name, source=info.model_uri, run_id=run_id, model_id=info.model_id,
        tags={"max_abs_diff": f"{max_abs_diff:.3g}", "atol": f"{atol:g}", "trained_model": trained_name,
              **(tags or {})},
    )
    return str(mv.version)


def load_compiled(store: TrackingStore, trained_name: str, version_or_alias: str,
                  backend: str | None = "export") -> Any:
    """The registered pyfunc (``mlflow.pyfunc.PyFuncModel``) of a compiled model version or alias."""
    ref = f"/{version_or_alias}" if str(version_or_alias).isdigit() else f"@{version_or_alias}"
    mlflow.set_tracking_uri(store.tracking_uri)
    config = {"backend": backend} if backend else None
    return mlflow.pyfunc.load_model(f"models:/{compiled_name(trained_name)}{ref}", model_config=config)
