"""The simulator's speed-ups that must be bit-identical to the code they replace: the compiled row evaluator of
`ThroughputModel.predict_rows`, stage 3's straggler medians from one sort, the prior-scaled refit's MAPE and its
cached observations, and the engine's arrivals merged into the event heap."""
from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from recforge.elastic.optimizer.instability_stage import _median_sorted
from recforge.elastic.optimizer.models.throughput_model import (
    TERMS,
    Allocation,
    OnlineThroughputModel,
    Sample,
    ThroughputModel,
    _mape_arrays,
    mape,
)


def _rows(rng: random.Random, n: int) -> list[tuple]:
    return [(float(rng.randint(1, 64)), float(rng.choice([1, 2, 3.5, 16])), float(rng.choice([1, 64, 512, 4096])),
             float(rng.choice([0, 0, 1, 3])), float(rng.choice([1.0, 2.0, 8.0])),
             rng.choice([math.inf, 4.0, 64.0])) for _ in range(n)]


def test_compiled_row_evaluator_equals_the_term_functions_bit_for_bit():
    rng = random.Random(0)
    names = list(TERMS)
    for _ in range(2000):
        terms = tuple(rng.sample(names, rng.randint(1, len(names))))
        coef = tuple(rng.choice([0.0, rng.random(), 10 ** rng.uniform(-9, 2)]) for _ in terms)
        m = ThroughputModel(terms, coef)
        rows = _rows(rng, rng.randint(0, 7))
        assert m.predict_rows(rows) == m.predict_rows_reference(rows)
    # every term alone, and the 1e-12 step-time floor
    for t in names:
        rows = _rows(rng, 20)
        m = ThroughputModel((t,), (0.0,))
        assert m.predict_rows(rows) == m.predict_rows_reference(rows)
        m = ThroughputModel((t,), (0.37,))
        assert m.predict_rows(rows) == m.predict_rows_reference(rows)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9])
def test_median_without_one_equals_statistics_median_of_the_others(n):
    rng = random.Random(n)
    for _ in range(300):
        xs = [rng.choice([0.5, 1.0, 1.0, 2.5, 7.0, rng.random()]) for _ in range(n)]
        srt = sorted(xs)
        assert _median_sorted(srt, len(srt)) == statistics.median(xs)
        if n >= 2:
            for i in range(n):
                others = xs[:i] + xs[i + 1:]
                k = srt.index(xs[i])  # any occurrence of the value: the same multiset is left
                assert _median_sorted(srt, k) == statistics.median(others)


def test_fast_mape_equals_mape():
    rng = np.random.default_rng(3)
    for n in [1, 2, 7, 31, 200, 513]:
        a = rng.lognormal(5, 2, n)
        p = a * rng.lognormal(0, 0.3, n)
        assert _mape_arrays(p, a) == mape(p, a)
    assert math.isnan(_mape_arrays(np.zeros(0), np.zeros(0)))


def test_prior_scaled_refit_keeps_its_observations_in_step_with_the_samples():
    prior = ThroughputModel(("const", "b_per_cpu", "log_w"), (0.03, 1.5e-3, 0.04))
    m = OnlineThroughputModel(prior.terms, prior, min_points=3, max_samples=10)
    rng = random.Random(5)

    def reference() -> float:  # the former arithmetic: observations read from the samples each time
        obs = np.array([s.samples_per_s for s in m.samples])
        pred = np.array(prior.predict_rows_reference([(float(s.allocation.workers), s.allocation.cpu_per_worker,
                                                        float(s.allocation.batch_size), 0.0, 1.0, math.inf)
                                                       for s in m.samples]))
        k = float(np.median(pred / obs))
        return mape(pred / k, obs)

    for i in range(25):
        m.add(Sample(Allocation(rng.choice([2, 3]), 4.0, 512), 1000.0 * rng.uniform(0.8, 1.2)), refit=False)
        if i == 12:
            m.samples = m.samples[3:]  # changed from outside
        if i == 17:
            m.samples.append(Sample(Allocation(2, 4.0, 512), 900.0))
        assert m.distinct_configs < 3
        m.refit()
        assert m.model is not None and m.model.fit_mape == reference()
