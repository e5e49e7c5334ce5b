"""A generic MLflow pyfunc: one artifact file and a loader that turns it into a predictor.

The packages that own a model kind (recforge.recom, recforge.elastic.optimizer) pass their loader in;
tracking never imports them. cloudpickle stores a module-level loader by reference (module and name),
so loading the pyfunc imports the owning package, as unpickling any class would.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mlflow.pyfunc import PythonModel

# loader(artifact path, model_config) -> predictor; predictor(model_input) -> the prediction
Loader = Callable[[str, Mapping[str, Any]], Callable[[Any], Any]]
ARTIFACT_KEY = "artifact"


class ArtifactPyfunc(PythonModel):
    """pyfunc whose `predict` calls what `loader` built from the logged artifact (`ARTIFACT_KEY`)."""

    def __init__(self, loader: Loader, artifact_key: str = ARTIFACT_KEY) -> None:
        self.loader = loader
        self.artifact_key = artifact_key

    def load_context(self, context) -> None:
        self.predictor = self.loader(context.artifacts[self.artifact_key], context.model_config or {})

    def predict(self, context, model_input, params=None):
        return self.predictor(model_input)
