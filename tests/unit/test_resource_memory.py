"""Memory model: fit, out-of-memory prediction, DLRover's relaunch sizing, embedding shard placement."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from recforge.elastic.optimizer.models.memory_model import (
    DEFAULT_MEMORY_MODEL,
    MEMORY_PROFILE,
    GiB,
    MemoryModel,
    MemorySample,
    MemoryTrend,
    embedding_bytes_per_rank,
    embedding_shard_bytes,
    fit_or_prior,
    leave_one_run_out,
    local_default_memory,
    next_memory,
    profile_memory_samples,
    samples_from_dicts,
)
from recforge.elastic.optimizer.models.throughput_model import ModelFitError

TRUE = MemoryModel(base_bytes=0.4 * GiB, emb_factor=2.5, growth_per_step=1e5)


def test_fit_recovers_base_embedding_factor_and_growth():
    pts = [MemorySample(e, s, TRUE.predict(e, s)) for e, s in itertools.product((1e7, 5e7, 2e8), (0, 1000, 5000))]
    m = MemoryModel.fit(pts)
    assert m.base_bytes == pytest.approx(TRUE.base_bytes, rel=1e-6)
    assert m.emb_factor == pytest.approx(TRUE.emb_factor, rel=1e-6)
    assert m.growth_per_step == pytest.approx(TRUE.growth_per_step, rel=1e-6)
    assert m.fit_mape < 1e-9 and m.fitted and m.n_points == 9


def test_fit_keeps_the_weights_resident_and_takes_what_the_points_cannot_tell_from_the_prior():
    # peaks below the weights' own size would need emb_factor < 1: the bound holds it at 1
    low = [MemorySample(e, s, 0.3 * GiB + 0.5 * e) for e, s in itertools.product((1e8, 5e8, 1e9), (0, 100))]
    assert MemoryModel.fit(low).emb_factor == pytest.approx(1.0)
    # one shard size and one step count: only the base is measured, the rest is the prior's
    prior = MemoryModel(0.1 * GiB, 3.0, 50.0)
    same = [MemorySample(1e7, 200, 0.6 * GiB * (1 + d), f"r{i}") for i, d in enumerate((-0.01, 0.0, 0.01))]
    m = MemoryModel.fit(same, prior)
    assert (m.emb_factor, m.growth_per_step) == (3.0, 50.0)
    assert m.predict(1e7, 200) == pytest.approx(0.6 * GiB, rel=1e-3)
    assert "emb_factor, growth_per_step from the prior" in m.source and m.n_runs == 3


def _runs(noise: float, n_runs: int = 5, seed: int = 0) -> list[MemorySample]:
    """Fixture: runs at different shard sizes and lengths, each rank's peak = TRUE x (1 + noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for r in range(n_runs):
        steps = 500 * (r + 1)
        for emb in (1e7 * (r + 1), 4e7 * (r + 1)):
            out.append(MemorySample(emb, steps, TRUE.predict(emb, steps) * (1 + rng.uniform(-noise, noise)), f"run{r}"))
    return out


def test_leave_one_run_out_error_on_fixtures():
    exact = leave_one_run_out(_runs(0.0))
    assert exact is not None and exact["runs"] == 5 and exact["mape"] < 1e-6
    noisy = _runs(0.05)
    loo = leave_one_run_out(noisy)
    # by hand: fit on the other runs, relative error of the held-out run's peaks
    errs = []
    for r in sorted({s.run for s in noisy}):
        m = MemoryModel.fit([s for s in noisy if s.run != r])
        errs += [abs(m.predict(s.embedding_bytes, s.step) - s.rss_bytes) / s.rss_bytes for s in noisy if s.run == r]
    assert loo["mape"] == pytest.approx(float(np.mean(errs)))
    assert 0 < loo["mape"] < 0.1
    assert leave_one_run_out(_runs(0.0, n_runs=1)) is None  # one run: nothing to hold out


def test_fit_or_prior_fits_with_enough_points_else_keeps_the_prior_and_says_why():
    m = fit_or_prior(_runs(0.02), DEFAULT_MEMORY_MODEL)
    assert m.fitted and m.n_runs == 5 and 0 < m.loo_mape < 0.1
    assert m.emb_factor == pytest.approx(TRUE.emb_factor, rel=0.2)
    none = fit_or_prior([], DEFAULT_MEMORY_MODEL)
    assert not none.fitted and none.base_bytes == DEFAULT_MEMORY_MODEL.base_bytes
    assert none.source.startswith("prior (constant prior") and "0 measured point(s), need 1" in none.source
    # one run of two ranks: base and embedding factor from its peaks, growth from the prior
    two = fit_or_prior(_runs(0.0)[:2], DEFAULT_MEMORY_MODEL)
    assert two.fitted and "growth_per_step from the prior" in two.source and math.isnan(two.loo_mape)
    assert two.emb_factor == pytest.approx(TRUE.emb_factor, rel=0.05)
    # one rank: the prior's shape calibrated to the measured peak
    one = fit_or_prior(_runs(0.0)[:1], DEFAULT_MEMORY_MODEL)
    assert one.fitted and one.emb_factor == DEFAULT_MEMORY_MODEL.emb_factor
    assert one.predict(_runs(0.0)[0].embedding_bytes, _runs(0.0)[0].step) == pytest.approx(_runs(0.0)[0].rss_bytes)


def test_bad_points_are_named_or_skipped():
    bad = _runs(0.0)[:3] + [MemorySample(1e7, -5, 1 * GiB, "runX")]
    with pytest.raises(ModelFitError, match=r"memory point 3 \(runX\): step=-5"):
        MemoryModel.fit(bad)
    with pytest.raises(ModelFitError, match="rss_bytes=nan"):
        MemoryModel.fit([MemorySample(1e7, 1, float("nan"))] * 3)
    kept = fit_or_prior(bad, DEFAULT_MEMORY_MODEL)
    assert not kept.fitted and "fit failed: memory point 3" in kept.source
    logged = [s.to_dict() for s in _runs(0.0)[:2]] + [{"embedding_bytes": "x"}, {"step": 1}, None]
    assert samples_from_dicts(logged, run="r") == [MemorySample(s.embedding_bytes, s.step, s.rss_bytes, "r")
                                                   for s in _runs(0.0)[:2]]


def test_embedding_bytes_per_rank_follows_the_sharding_plan():
    tables = [("a", 100), ("b", 1000), ("c", 10)]
    plan = {"a": {"sharding_type": "table_wise", "ranks": [1]}, "b": {"sharding_type": "row_wise", "ranks": [0, 1]},
            "c": {"sharding_type": "data_parallel", "ranks": []}}
    assert embedding_bytes_per_rank(plan, tables, 4, 2) == [(500 * 4 + 10 * 4) * 4, (100 * 4 + 500 * 4 + 10 * 4) * 4]
    with pytest.raises(ValueError, match=r"tables \['z'\]"):
        embedding_bytes_per_rank({"z": {"sharding_type": "table_wise", "ranks": [0]}}, tables, 4, 2)


def test_the_committed_profile_gives_the_cold_start_memory_prior():
    m = local_default_memory()
    assert not m.fitted and m.source.startswith(f"committed profile {MEMORY_PROFILE.name}") and m.n_runs >= 8
    assert 0 < m.loo_mape < 0.2 and 0.2 * GiB < m.base_bytes < 2 * GiB
    # its two table sizes determine the embedding factor: measured, not the prior's 2.0
    assert "from the prior" not in m.source and m.emb_factor > 1.0, m.source
    peaks = profile_memory_samples(MEMORY_PROFILE)
    assert max(s.embedding_bytes for s in peaks) > 3 * min(s.embedding_bytes for s in peaks)


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
    with pytest.raises(ModelFitError, match="need at least 1 measured peak"):
        MemoryModel.fit([])
    with pytest.raises(ModelFitError, match="rss_bytes"):
        MemoryModel.fit([MemorySample(1, 1, 0)] * 3)
    with pytest.raises(ModelFitError, match="growth_per_step"):
        MemoryModel(1.0, 1.0, -1.0)
    with pytest.raises(ModelFitError, match="not a memory model"):
        MemoryModel.from_dict({"base_bytes": 1})
