"""The planner constraints derived from TrainConfig.sharding / fused_embeddings (DMP itself: integration tests)."""
from __future__ import annotations

import pytest

from recforge.config import TrainConfig
from recforge.train.sharding import sharding_constraints


@pytest.mark.parametrize(
    "sharding, fused, types, kernels",
    [
        ("auto", True, ["table_wise", "column_wise", "data_parallel"], ["fused", "dense"]),
        ("table_wise", True, ["table_wise"], ["fused"]),
        ("column_wise", True, ["column_wise"], ["fused"]),
        ("data_parallel", True, ["data_parallel"], ["dense"]),
        ("auto", False, ["data_parallel"], ["dense"]),
        ("data_parallel", False, ["data_parallel"], ["dense"]),
    ],
)
def test_constraints(sharding, fused, types, kernels):
    cons = sharding_constraints(TrainConfig(sharding=sharding, fused_embeddings=fused), ["C1", "C2"])
    assert sorted(cons) == ["C1", "C2"]
    for c in cons.values():
        assert c.sharding_types == types
        assert c.compute_kernels == kernels


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_plain_kernel_with_model_parallel_sharding_is_refused(sharding):
    with pytest.raises(ValueError, match="data_parallel"):
        sharding_constraints(TrainConfig(sharding=sharding, fused_embeddings=False), ["C1"])
