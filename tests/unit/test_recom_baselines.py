"""The TorchRec / fbgemm TBE baselines compute the same embedding layer and model as eager."""
from __future__ import annotations

import pytest
import torch

from recforge.recom.baselines import DenseNet, EBCLayer, GroupedPreprocess, Pipeline, TBELayer
from recforge.recom.family import make_features
from test_recom_columns_fixtures import eager, small_model


@pytest.fixture(scope="module")
def model():
    return small_model()


@pytest.mark.parametrize("lookup", [TBELayer, EBCLayer])
@pytest.mark.parametrize("rows", [1, 13])
def test_layer_baselines_match_eager(model, lookup, rows):
    layer = Pipeline(GroupedPreprocess(model), lookup(model))
    f = make_features(model, rows, seed=rows, empty_rate=0.3)
    torch.testing.assert_close(eager(layer, f), eager(model.embedding, f), rtol=1e-5, atol=1e-5)


def test_whole_model_baseline_matches_eager(model):
    full = Pipeline(GroupedPreprocess(model), TBELayer(model), DenseNet(model))
    f = make_features(model, 9, seed=1)
    torch.testing.assert_close(eager(full, f), eager(model, f), rtol=1e-5, atol=1e-5)


def test_preprocess_layout(model):
    pre = GroupedPreprocess(model)
    f = make_features(model, 4, seed=2)
    ids, offsets, weights = eager(pre, f)
    tables = len(model.embedding.columns)
    assert offsets.shape == (tables * 4 + 1,) and offsets[-1] == ids.shape[0] == weights.shape[0]
