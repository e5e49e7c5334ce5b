"""AUC / logloss / NE against sklearn; evaluate() over an ingested manifest is batch-size invariant."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from recforge.config import DatasetConfig, DenseFeature, ModelConfig, SparseFeature
from recforge.data.generator import generate_days
from recforge.data.ingest import ingest
from recforge.preprocess.executor import TorchExecutor
from recforge.preprocess.planning.plan import criteo_plan
from recforge.train.metrics import (
    NonFiniteMetricsError,
    auc,
    base_entropy,
    evaluate,
    logloss,
    normalized_entropy,
    predict,
)
from recforge.train.model import build_dlrm


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    y = (rng.random(500) < 0.3).astype(np.float64)
    z = rng.normal(size=500) + 1.5 * y
    assert auc(y, z) == pytest.approx(roc_auc_score(y, z), abs=1e-12)
    assert logloss(y, z) == pytest.approx(log_loss(y, _sigmoid(z)), rel=1e-9)
    p = y.mean()
    expected = log_loss(y, _sigmoid(z)) / log_loss(y, np.full_like(y, p))
    assert normalized_entropy(y, z) == pytest.approx(expected, rel=1e-9)


def test_auc_with_ties_and_extremes():
    y = np.array([0, 0, 1, 1, 0, 1])
    z = np.array([0.1, 0.5, 0.5, 0.9, 0.5, 0.1])  # ties across classes count half
    assert auc(y, z) == pytest.approx(roc_auc_score(y, z))
    assert auc([0, 1], [0.0, 1.0]) == 1.0
    assert auc([0, 1], [1.0, 0.0]) == 0.0
    assert auc([0, 1, 0, 1], [3.0, 3.0, 3.0, 3.0]) == 0.5
    # logloss stays finite on huge logits (computed from logits, not probabilities)
    assert logloss([1, 0], [800.0, -800.0]) == pytest.approx(0.0, abs=1e-12)
    assert np.isfinite(logloss([0, 1], [800.0, -800.0]))


def test_base_rate_prediction_has_ne_one():
    y = np.array([1, 0, 0, 0, 1, 0, 0, 0])
    p = y.mean()
    z = np.full(y.shape, np.log(p / (1 - p)))
    assert normalized_entropy(y, z) == pytest.approx(1.0)
    assert base_entropy(y) == pytest.approx(log_loss(y, np.full(y.shape, p)))


@pytest.mark.parametrize("bad", [dict(labels=[1, 1], scores=[0.1, 0.2]), dict(labels=[0, 2], scores=[0.1, 0.2]),
                                 dict(labels=[0, 1], scores=[0.1]), dict(labels=[], scores=[])])
def test_auc_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        auc(bad["labels"], bad["scores"])


SMALL = DatasetConfig(
    name="small",
    dense=[DenseFeature(name="I1", missing_rate=0.2), DenseFeature(name="I2")],
    sparse=[SparseFeature(name="C1", cardinality=50, missing_rate=0.1), SparseFeature(name="C2", cardinality=500)],
)


@pytest.fixture(scope="module")
def small_manifest(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    generate_days(SMALL, root / "raw", days=1, rows_per_day=1500, seed=0)
    ingest([root / "raw" / "day_0.tsv"], SMALL, root / "data", rows_per_shard=600, max_bad_fraction=0.0)
    return root


def test_evaluate_over_a_manifest_is_batch_size_invariant(small_manifest):
    tmp_path = small_manifest
    plan = criteo_plan(SMALL, table_cap=100)
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=4, dense_arch=[8, 4], over_arch=[8, 1]), plan.tables(), 2)
    ex = TorchExecutor(plan, SMALL)
    y, z = predict(model, ex, tmp_path / "data", batch_size=4096)
    y2, z2 = predict(model, ex, tmp_path / "data", batch_size=37)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_allclose(z, z2, rtol=1e-5, atol=1e-6)  # same rows in the same order, any batch size
    a = evaluate(model, ex, tmp_path / "data", batch_size=4096)
    assert a["rows"] == 1500
    assert a["auc"] == pytest.approx(roc_auc_score(y, z))
    assert a["logloss"] == pytest.approx(log_loss(y, _sigmoid(z.astype(np.float64))), rel=1e-6)
    assert model.training  # evaluate restores the mode it found


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_evaluate_fails_on_a_model_with_non_finite_weights(small_manifest, poison):
    plan = criteo_plan(SMALL, table_cap=100)
    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(embedding_dim=4, dense_arch=[8, 4], over_arch=[8, 1]), plan.tables(), 2)
    with torch.no_grad():
        next(model.parameters()).view(-1)[:4] = poison  # as a corrupted checkpoint would leave it
    with pytest.raises(NonFiniteMetricsError, match=r"logits are not finite on \d+ of 1500 rows"):
        evaluate(model, TorchExecutor(plan, SMALL), small_manifest / "data", batch_size=512)
