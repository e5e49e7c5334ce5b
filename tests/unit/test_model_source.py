"""Models are loaded (unpickled) only from the configured MLflow store's registry or its runs
(recforge.tracking.model_source), against a real SQLite store: other registries, paths, URLs, unknown runs and
versions registered from elsewhere are refused, naming what was asked for."""
from __future__ import annotations

import pytest
import torch
from mlflow.exceptions import MlflowException

from recforge.tracking import ModelRegistry, TrackingStore
from recforge.tracking.model_source import UntrustedModelError, trusted_location
from recforge.tracking.recom_models import load_compiled
from recforge.tracking.resource_models import load_resource_model

NAME = "trusted-model"


@pytest.fixture(scope="module")
def registered(tmp_path_factory, mlflow_db):
    d = tmp_path_factory.mktemp("mlflow")
    store = TrackingStore(mlflow_db(d / "mlflow.db"), d / "artifacts")
    registry = ModelRegistry(store, NAME)
    run_id = store.stage_run("exp", "day1", "publish")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    version = registry.log_and_register(run_id, model, auc=0.7)
    store.client.set_registered_model_alias(NAME, "champion", version)
    return store, registry, run_id, version, model


def test_a_version_of_this_registry_loads_by_alias_and_number(registered):
    store, registry, run_id, version, model = registered
    x = torch.randn(4, 3)
    assert torch.equal(registry.load("champion")(x), model(x))
    assert trusted_location(store, f"models:/{NAME}/{version}") == trusted_location(store, f"models:/{NAME}@champion")
    assert trusted_location(store, f"runs:/{run_id}/model").endswith(f"{run_id}/artifacts/model")


@pytest.mark.parametrize("uri, why", [
    ("/tmp/model", "it is a path or URL"),
    ("file:///tmp/model", "it is a path or URL"),
    ("https://models.example.com/recforge-dlrm.pkl", "it is a path or URL"),
    ("s3://bucket/recforge-dlrm", "it is a path or URL"),
    ("models://profile@databricks/trusted-model/1", "it names another registry or tracking server"),
    ("models:/trusted-model/../../etc", "it names another registry or tracking server, or is malformed"),
    ("runs:/0123456789abcdef0123456789abcdef/model", "is not a run of the configured store"),
    ("models:/m-0123456789abcdef", "is not a logged model of the configured store"),
])
def test_anything_else_is_refused_naming_it(registered, uri, why):
    store = registered[0]
    with pytest.raises(UntrustedModelError, match="refusing model") as e:
        trusted_location(store, uri)
    assert repr(uri) in str(e.value) and why in str(e.value)


@pytest.mark.parametrize("uri", ["models:/trusted-model/99", "models:/trusted-model@nobody", "models:/nope/latest"])
def test_a_version_the_registry_does_not_have_is_not_found(registered, uri):
    with pytest.raises(MlflowException, match=r"nobody not found|version=99\) not found|nope has no version"):
        trusted_location(registered[0], uri)  # MLflow's own "not found" (UntrustedModelError is no MlflowException)


def test_a_version_registered_from_elsewhere_is_refused(registered, tmp_path):
    store, registry, run_id, _, _ = registered
    evil = tmp_path / "evil"
    evil.mkdir()
    foreign = store.client.create_model_version(NAME, source=str(evil), run_id=run_id)  # a registry writer's choice
    with pytest.raises(UntrustedModelError, match=f"version {foreign.version}\\): its source '{evil}' is not an "
                                                  f"artifact of its run {run_id}"):
        registry.load(foreign.version)
    orphan = store.client.create_model_version(NAME, source=f"file://{evil}")
    with pytest.raises(UntrustedModelError, match="it names no run of this store"):
        registry.load(orphan.version)


def test_the_loaders_refuse_malformed_references_and_foreign_uris(registered):
    store, registry = registered[0], registered[1]
    with pytest.raises(UntrustedModelError, match="'1; rm -rf /' is not a registered model reference"):
        registry.load("1; rm -rf /")
    with pytest.raises(UntrustedModelError, match="'/tmp/resource_model': it is a path or URL"):
        load_resource_model("/tmp/resource_model", store.tracking_uri)
    with pytest.raises(UntrustedModelError, match="'../champion' is not a registered model reference"):
        load_compiled(store, NAME, "../champion")
