"""Resource-performance model: NNLS fit against known truths and a plain reference, term selection, online refit."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from recforge.elastic.optimizer.models.throughput_model import (
    PS_TERMS,
    Allocation,
    ModelFitError,
    OnlineThroughputModel,
    Sample,
    ThroughputModel,
    cross_validate,
    design_matrix,
    fit,
    mape,
    select_terms,
)

TRUE = ThroughputModel(("const", "b_per_cpu", "w"), (0.01, 2e-4, 0.003))


def _grid(model=TRUE, noise=0.0, seed=0, host=None):
    rng = np.random.default_rng(seed)
    out = []
    for w, c, b in itertools.product((1, 2, 3, 4), (1, 2, 4), (256, 512, 1024)):
        a = Allocation(w, float(c), b, host_cores=host)
        out.append(Sample(a, model.predict(a) * float(np.exp(rng.normal(0, noise)))))
    return out


def test_fit_recovers_known_coefficients_exactly_without_noise():
    m = fit(_grid(), TRUE.terms)
    np.testing.assert_allclose(m.coef, TRUE.coef, rtol=1e-6)
    assert m.fit_mape < 1e-9


def test_fit_matches_a_plain_nonnegative_least_squares_reference():
    """Same problem solved by brute force: unconstrained lstsq on every subset of active columns."""
    samples = _grid(noise=0.1, seed=3)
    terms = ("const", "b_per_cpu", "b", "w")
    allocs = [s.allocation for s in samples]
    t = np.array([a.workers * a.batch_size / s.samples_per_s for a, s in zip(allocs, samples, strict=True)])
    X = design_matrix(allocs, terms) / t[:, None]
    y = np.ones(len(t))
    best = None
    for k in range(1, len(terms) + 1):
        for active in itertools.combinations(range(len(terms)), k):
            c, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
            if (c < 0).any():
                continue
            full = np.zeros(len(terms))
            full[list(active)] = c
            r = float(np.sum((X @ full - y) ** 2))
            if best is None or r < best[0] - 1e-15:
                best = (r, full)
    m = fit(samples, terms, irls_iters=0)
    np.testing.assert_allclose(m.coef, best[1], rtol=1e-6, atol=1e-12)
    assert all(c >= 0 for c in m.coef)


def test_reweighting_lowers_the_throughput_error_it_targets():
    samples = _grid(noise=0.4, seed=7)
    plain = fit(samples, TRUE.terms, irls_iters=0)
    irls = fit(samples, TRUE.terms)
    assert irls.fit_mape <= plain.fit_mape + 1e-12


def test_predict_matches_the_formula_and_single_vs_batch():
    a = Allocation(3, 2.0, 512)
    expected = 3 * 512 / (0.01 + 2e-4 * 512 / 2 + 0.003 * 3)
    assert TRUE.predict(a) == pytest.approx(expected)
    assert TRUE.predict([a, a]) == pytest.approx([expected, expected])


def test_parameter_server_terms_and_oversubscription_columns():
    a = Allocation(8, 4.0, 512, servers=2, cpu_per_server=4.0)
    X = design_matrix([a], PS_TERMS)[0]
    np.testing.assert_allclose(X, [1, 512 / 4, (8 / 2) * 512 / 4, 8 / 2, 2, 8])
    over = design_matrix([Allocation(3, 2.0, 100, host_cores=2.0), Allocation(1, 1.0, 100, host_cores=2.0)],
                         ["b_per_cpu_oversub", "b_threads"])
    np.testing.assert_allclose(over, [[100 / 2 * 3, 100], [100, 0]])


def test_select_terms_finds_the_generating_terms():
    sel = select_terms(_grid(noise=0.01, seed=1), ("const", "b_per_cpu", "b", "w", "bw"), max_terms=4)
    assert set(sel.terms) == set(TRUE.terms)
    assert sel.cv_mape < 0.03
    assert sel.ranking[0][1] <= sel.ranking[-1][1]


def test_cross_validation_holds_out_whole_configurations():
    samples = _grid(noise=0.05, seed=2)
    samples += [Sample(s.allocation, s.samples_per_s * 1.02) for s in samples]  # a repetition of every config
    err = cross_validate(samples, TRUE.terms)
    assert 0 < err < 0.2


@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan"), float("inf")])
def test_fit_rejects_non_positive_or_non_finite_throughput(bad):
    samples = _grid()[:5] + [Sample(Allocation(1, 1.0, 512), bad)]
    with pytest.raises(ModelFitError, match="throughput"):
        fit(samples, TRUE.terms)


def test_fit_with_too_few_points_names_the_problem():
    with pytest.raises(ModelFitError, match="2 points cannot determine 3 coefficients"):
        fit(_grid()[:2], TRUE.terms)
    with pytest.raises(ModelFitError, match="unknown model terms"):
        fit(_grid(), ("const", "nope"))
    with pytest.raises(ModelFitError, match="need at least 3"):
        select_terms(_grid()[:2])


def test_allocation_and_model_validation():
    with pytest.raises(ValueError, match="workers"):
        Allocation(0, 1.0, 10)
    with pytest.raises(ValueError, match="cpu_per_server"):
        Allocation(1, 1.0, 10, servers=2)
    with pytest.raises(ModelFitError, match=">= 0"):
        ThroughputModel(("const",), (-1.0,))
    with pytest.raises(ModelFitError, match="not a throughput model"):
        ThroughputModel.from_dict({"coef": [1.0]})
    again = ThroughputModel.from_dict(TRUE.to_dict())
    assert again.terms == TRUE.terms and again.coef == TRUE.coef


def test_prior_pull_keeps_a_few_points_from_wrecking_a_good_model():
    prior = ThroughputModel(TRUE.terms, tuple(c * 1.3 for c in TRUE.coef))
    few = _grid(noise=0.3, seed=9)[:2]
    m = fit(few, TRUE.terms, prior=prior, prior_strength=1.0)
    assert all(c > 0 for c in m.coef)  # nothing collapsed to 0 as an unregularised 2-point fit would
    test = _grid()
    assert mape(m.predict([s.allocation for s in test]), [s.samples_per_s for s in test]) < 0.35


def test_online_model_uses_the_prior_until_it_sees_enough_configurations_then_converges():
    prior = ThroughputModel(TRUE.terms, tuple(c * 2 for c in TRUE.coef))
    online = OnlineThroughputModel(TRUE.terms, prior, min_points=3, prior_strength=0.3)
    a = Allocation(2, 2.0, 512)
    online.add(Sample(a, TRUE.predict(a)))
    assert "prior scaled" in online.status
    # one configuration: the prior's shape, rescaled to what is seen there
    assert online.model.predict(a) == pytest.approx(TRUE.predict(a), rel=1e-9)
    for s in _grid(noise=0.02, seed=4):
        online.add(s)
    assert online.status.startswith("fitted on")
    test = _grid()
    assert mape(online.model.predict([s.allocation for s in test]), [s.samples_per_s for s in test]) < 0.05


def test_online_model_without_prior_waits_and_ignores_stalled_intervals():
    online = OnlineThroughputModel(TRUE.terms, None)
    assert online.add(Sample(Allocation(1, 1.0, 512), 0.0)) is False and not online.samples
    online.add(Sample(Allocation(1, 1.0, 512), 1000.0))
    assert online.model is None and "no prior" in online.status
    for s in _grid()[:6]:
        online.add(s)
    assert online.model is not None and math.isfinite(online.model.fit_mape)
