"""Registering models, the champion quality gate (pure function, every branch) and its application against a real
MLflow SQLite store."""
import math

import pytest
import torch

from recforge.tracking import ModelRegistry, TrackingStore
from recforge.tracking.registry import ChampionChangedError, gate

FLOOR = dict(margin=0.01, min_auc=0.6, min_rows=1000)


def _register(store, registry, key, auc, tags=None):
    run_id = store.stage_run("exp", key, "publish")
    return run_id, registry.log_and_register(run_id, torch.nn.Linear(3, 1), auc=auc, tags=tags)


@pytest.mark.parametrize("auc", [math.nan, math.inf, -math.inf])
def test_gate_never_promotes_a_non_finite_auc(auc):
    for champion_auc in (None, 0.7):
        d = gate(auc, 5000, champion_auc=champion_auc, champion_version="1" if champion_auc else None, **FLOOR)
        assert not d.promote and "not finite" in d.reason


def test_gate_needs_enough_rows_and_the_floor_even_without_a_champion():
    few = gate(0.9, 100, champion_auc=None, **FLOOR)  # a 100-row day does not crown a champion
    assert not few.promote and "100 held-out rows < champion_min_rows 1000" in few.reason
    low = gate(0.58, 5000, champion_auc=None, **FLOOR)
    assert not low.promote and "below the floor champion_min_auc 0.6" in low.reason
    first = gate(0.6, 1000, champion_auc=None, **FLOOR)  # at the floor and the row minimum: promoted
    assert first.promote and "no champion yet" in first.reason


def test_gate_compares_with_the_champion_on_the_same_day():
    worse = gate(0.70, 5000, champion_auc=0.72, champion_version="3", **FLOOR)
    assert not worse.promote and "below by more than margin 0.01" in worse.reason and "v3 0.7200" in worse.reason
    within = gate(0.715, 5000, champion_auc=0.72, champion_version="3", **FLOOR)
    assert within.promote and "within margin" in within.reason
    better = gate(0.75, 5000, champion_auc=0.72, champion_version="3", **FLOOR)
    assert better.promote
    # the floor holds even when the champion is worse still
    assert not gate(0.59, 5000, champion_auc=0.55, champion_version="3", **FLOOR).promote


def test_gate_replaces_a_champion_that_cannot_be_scored():
    broken = gate(0.7, 5000, champion_auc=None, champion_version="3", champion_problem="loading its model: boom",
                  **FLOOR)
    assert broken.promote and "v3 could not be scored (loading its model: boom)" in broken.reason
    nan = gate(0.7, 5000, champion_auc=math.nan, champion_version="3", **FLOOR)  # a NaN champion blocks nothing
    assert nan.promote and "could not be scored" in nan.reason
    # but not with a challenger that fails the absolute checks
    assert not gate(0.5, 5000, champion_auc=None, champion_version="3", champion_problem="x", **FLOOR).promote


def test_champion_moves_only_through_the_gate(recforge_home, tmp_path):
    store = TrackingStore()
    registry = ModelRegistry(store, "test-model")
    assert registry.champion_ref() is None
    run1 = store.stage_run("exp", "day1", "publish")
    (tmp_path / "preprocess_plan.json").write_text('{"name": "p"}')
    store.log_artifact(run1, tmp_path / "preprocess_plan.json", "plan")  # as publish logs the model's plan
    v1 = registry.log_and_register(run1, torch.nn.Linear(3, 1), auc=0.75, tags={"run_key": "day1"})
    d1 = registry.promote(v1, auc=0.75, rows=5000, champion_version=None, champion_auc=None, **FLOOR)
    assert d1.promoted and d1.champion_version is None
    ref = registry.champion_ref()  # the lookup reads the alias and the version's tags back from the store
    assert ref.version == v1 and ref.tags["run_key"] == "day1" and ref.tags["auc"] == "0.750000"
    assert store.client.get_model_version("test-model", v1).tags["promotion"] == d1.reason
    assert registry.download(v1, "plan/preprocess_plan.json", tmp_path / "dl").read_text() == '{"name": "p"}'

    _, v2 = _register(store, registry, "day2", 0.70)
    d2 = registry.promote(v2, auc=0.70, rows=5000, champion_version=v1, champion_auc=0.74, **FLOOR)
    assert not d2.promoted and "below by more than margin" in d2.reason and registry.champion_ref().version == v1
    d3 = registry.promote(v2, auc=0.70, rows=5000, champion_version=v1, champion_auc=0.705, **FLOOR)
    assert d3.promoted and registry.champion_ref().version == v2
    # a retry of the same publish: already champion
    again = registry.promote(v2, auc=0.70, rows=5000, champion_version=v1, champion_auc=0.705, **FLOOR)
    assert again.promoted and again.reason == f"already champion ({d3.reason})"

    # the champion moved since it was scored (v1 scored, v2 is champion now): the comparison is stale
    _, v3 = _register(store, registry, "day3", 0.9)
    with pytest.raises(ChampionChangedError, match=f"now {v2}, not the scored {v1}"):
        registry.promote(v3, auc=0.9, rows=5000, champion_version=v1, champion_auc=0.7, **FLOOR)
    assert registry.champion_ref().version == v2


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
