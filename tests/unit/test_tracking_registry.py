"""Registering models and the champion quality gate, against a real MLflow SQLite store."""
import torch

from recforge.tracking import ModelRegistry, TrackingStore


def _register(store, registry, key, auc):
    run_id = store.stage_run("exp", key, "publish")
    return run_id, registry.log_and_register(run_id, torch.nn.Linear(3, 1), auc=auc)


def test_champion_moves_only_within_margin(recforge_home):
    store = TrackingStore()
    registry = ModelRegistry(store, "test-model")
    _, v1 = _register(store, registry, "day1", 0.75)
    d1 = registry.promote_if_not_worse(v1, 0.75, margin=0.01)
    assert d1.promoted and d1.champion_version is None and str(registry.champion().version) == v1

    _, v2 = _register(store, registry, "day2", 0.745)  # worse, but within the margin
    d2 = registry.promote_if_not_worse(v2, 0.745, margin=0.01)
    assert d2.promoted and str(registry.champion().version) == v2

    _, v3 = _register(store, registry, "day3", 0.70)  # worse than the champion by more than the margin
    d3 = registry.promote_if_not_worse(v3, 0.70, margin=0.01)
    assert not d3.promoted and "below" in d3.reason
    assert str(registry.champion().version) == v2


def test_registration_is_idempotent_per_run(recforge_home):
    store = TrackingStore()
    registry = ModelRegistry(store, "test-model")
    run_id, v1 = _register(store, registry, "day1", 0.7)
    assert registry.log_and_register(run_id, torch.nn.Linear(3, 1), auc=0.7) == v1
    assert len(store.client.search_model_versions("name = 'test-model'")) == 1


def test_registered_model_loads_back(recforge_home):
    store = TrackingStore()
    registry = ModelRegistry(store, "test-model")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    run_id = store.stage_run("exp", "k", "publish")
    version = registry.log_and_register(run_id, model, auc=0.7)
    loaded = registry.load(version)
    x = torch.randn(4, 3)
    assert torch.equal(loaded(x), model(x))


def test_stage_runs_are_reused_and_params_are_checked(recforge_home):
    store = TrackingStore()
    a = store.stage_run("exp", "k", "train")
    assert store.stage_run("exp", "k", "train") == a
    store.log_params(a, {"x": 1, "nested": {"y": 2}})
    store.log_params(a, {"x": 1})  # same value again is fine
    import pytest

    with pytest.raises(ValueError, match="param 'x'"):
        store.log_params(a, {"x": 2})
    assert store.client.get_run(a).data.params == {"x": "1", "nested.y": "2"}
