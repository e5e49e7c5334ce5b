"""Memory model: fit, out-of-memory prediction, DLRover's relaunch sizing, embedding shard placement."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from recforge.elastic.optimizer.models.memory_model import (
    GiB,
    MemoryModel,
    MemorySample,
    MemoryTrend,
    embedding_shard_bytes,
    next_memory,
)
from recforge.elastic.optimizer.models.throughput_model import ModelFitError

TRUE = MemoryModel(base_bytes=0.4 * GiB, emb_factor=2.5, growth_per_step=1e5)


def test_fit_recovers_base_embedding_factor_and_growth():
    pts = [MemorySample(e, s, TRUE.predict(e, s)) for e, s in itertools.product((1e7, 5e7, 2e8), (0, 1000, 5000))]
    m = MemoryModel.fit(pts)
    assert m.base_bytes == pytest.approx(TRUE.base_bytes, rel=1e-6)
    assert m.emb_factor == pytest.approx(TRUE.emb_factor, rel=1e-6)
    assert m.growth_per_step == pytest.approx(TRUE.growth_per_step, rel=1e-6)
    assert m.fit_mape < 1e-9


def test_oom_prediction_before_it_happens():
    limit = TRUE.predict(1e8, 10_000)
    assert TRUE.steps_until(limit, 1e8, 4_000) == pytest.approx(6_000)
    assert TRUE.will_oom(limit * 0.99, 1e8, 10_000)
    assert not TRUE.will_oom(limit * 1.01, 1e8, 10_000)
    assert TRUE.steps_until(1.0, 1e8) == 0.0
    flat = MemoryModel(1 * GiB, 1.0, 0.0)
    assert flat.steps_until(2 * GiB, 0) == math.inf


@pytest.mark.parametrize("current, expected", [
    (2 * GiB, 4 * GiB),        # doubles
    (10 * GiB, 18 * GiB),      # +8 GiB at most a step
    (60 * GiB, 64 * GiB),      # never above the cap
])
def test_next_memory_doubles_with_the_8_gib_step_and_64_gib_cap(current, expected):
    assert next_memory(current) == expected


def test_next_memory_covers_a_predicted_need_within_the_step():
    assert next_memory(2 * GiB, needed_bytes=5 * GiB) == 5 * GiB
    assert next_memory(2 * GiB, needed_bytes=30 * GiB) == 10 * GiB


def test_embedding_shard_bytes_matches_brute_force_best_greedy_placement():
    rng = np.random.default_rng(0)
    for _ in range(20):
        tables = list(rng.integers(1, 100, size=6).astype(float))
        for w in (1, 2, 3):
            got = embedding_shard_bytes(tables, w)
            optimum = min(max(sum(t for t, a in zip(tables, assign, strict=True) if a == k) for k in range(w))
                          for assign in itertools.product(range(w), repeat=len(tables)))
            assert optimum <= got <= optimum * 4 / 3 + 1e-9  # LPT's bound
    assert embedding_shard_bytes([5.0, 3.0], 1) == 8.0
    with pytest.raises(ValueError, match="workers"):
        embedding_shard_bytes([1.0], 0)


def test_memory_trend_extrapolates_to_exhaustion():
    tr = MemoryTrend(window=5)
    for s in range(0, 500, 100):
        tr.add(s, 1 * GiB + 1e6 * s)
    assert tr.slope() == pytest.approx(1e6)
    assert tr.steps_to_exhaustion(1 * GiB + 1e6 * 1400) == pytest.approx(1000)
    assert tr.predicted_at(900) == pytest.approx(1 * GiB + 9e8)
    assert MemoryTrend().steps_to_exhaustion(1.0) == math.inf


def test_bad_memory_inputs_are_clear():
    with pytest.raises(ModelFitError, match="at least 3"):
        MemoryModel.fit([MemorySample(1, 1, 1)])
    with pytest.raises(ModelFitError, match="rss_bytes"):
        MemoryModel.fit([MemorySample(1, 1, 0)] * 3)
    with pytest.raises(ModelFitError, match="growth_per_step"):
        MemoryModel(1.0, 1.0, -1.0)
    with pytest.raises(ModelFitError, match="not a memory model"):
        MemoryModel.from_dict({"base_bytes": 1})
