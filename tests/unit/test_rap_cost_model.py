"""Cost model: the fit against numpy's least squares on exact data, held-out accuracy, group predictions, a small
real measurement of the fused executor; Gantt PNG of a schedule."""
from __future__ import annotations

import numpy as np
import pytest

from recforge.preprocess.planning.compiler import FusedGroup, compile_plan
from recforge.preprocess.presets import load_plan
from recforge.rap.profiling.cost_model import (
    CostModel,
    Measurement,
    design_row,
    fit,
    fit_op,
    node_widths,
    predict_group,
)
from recforge.rap.profiling.cost_probe import OPS, measure, probe_case, time_group

TRUE = {"logit": [0.01, 0.002, 1e-6, 0.0, 0.0], "sigrid_hash": [0.02, 0.001, 0.0, 3e-6, 2e-6]}


def _exact(op, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in (1, 2, 4, 8, 16):
        for rows in (256, 1024, 4096, 65536):
            for w in (1, 4):
                ms = float(np.dot(TRUE[op], design_row(n, rows, w)))
                out.append(Measurement(op, n, rows, float(w), ms * (1 + noise * rng.standard_normal())))
    return out


@pytest.mark.parametrize("op", sorted(TRUE))
def test_fit_recovers_exact_coefficients_like_lstsq(op):
    data = _exact(op)
    coef = fit_op(data)
    x = np.array([design_row(m.n, m.rows, m.width) for m in data])
    y = np.array([m.ms for m in data])
    ref, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    np.testing.assert_allclose(x @ coef, y, rtol=1e-6)
    np.testing.assert_allclose(x @ ref, y, rtol=1e-6)


def test_heldout_accuracy_is_reported_per_op():
    data = _exact("logit", noise=0.02) + _exact("sigrid_hash", noise=0.02)
    model, report = fit(data, holdout=0.2)
    assert report["heldout_n"] == 16 and set(report["heldout_within_10pct_by_op"]) == set(TRUE)
    assert report["heldout_within_10pct"] == 1.0  # 2% noise: every prediction within 10%
    assert model.accuracy([Measurement("logit", 4, 1024, 1.0, 1.0)]) == 0.0
    assert CostModel.from_json(model.to_json()).coef == model.coef


def test_bad_inputs():
    with pytest.raises(ValueError, match="'logit' has 3 measurements"):
        fit(_exact("logit")[:3])
    with pytest.raises(KeyError, match="boxcox"):
        CostModel(TRUE).predict("boxcox", 1, 10)
    with pytest.raises(ValueError, match="coefficients"):
        CostModel.from_json('{"coef": {"logit": [1, 2]}}')


def test_group_prediction_sums_rows_and_splits_list_sources():
    plan = load_plan("plan2")
    compiled = compile_plan(plan, method="greedy")
    widths = node_widths(compiled.graph)
    onehot = next(n for n in compiled.graph.nodes if n.op == "onehot")
    assert widths[onehot.id] == onehot.params["C"]
    ngram = next(n for n in compiled.graph.nodes if n.op == "ngram")
    parent = compiled.graph.nodes[ngram.parent]
    assert parent.op == "onehot" and widths[ngram.id] == parent.params["C"]  # ngram reads onehot's C values
    model = CostModel({op: [1.0, 0.0, 0.001, 0.0, 0.0] for op in ("fill_null", "fill_null[list]")})
    g = next(g for g in compiled.groups if g.op == "fill_null" and g.cls == "sparse")
    assert predict_group(model, compiled, g, 100.0) == pytest.approx(1.0 + 0.001 * 100 * len(g.nodes))
    src = compiled.graph.nodes[g.nodes[0]].source
    both = predict_group(model, compiled, g, 100.0, {src: 3.0})  # one list source: two launches
    assert both == pytest.approx(2.0 + 0.001 * 100 * len(g.nodes))
    half = FusedGroup(g.layer, g.op, g.cls, g.nodes[:2])
    assert predict_group(model, compiled, half, lambda n: 10.0) == pytest.approx(1.0 + 0.001 * 20)


def test_real_measurements_of_the_fused_executor():
    data = measure(ops=OPS, degrees=(1, 4), rows=(256,), widths=(1, 3), repeats=2)
    assert {m.op for m in data} == set(OPS)
    assert all(m.ms > 0 for m in data)
    assert any(m.jagged for m in data) and any(not m.jagged for m in data)
    ex, raw, gi = probe_case("sigrid_hash", 3, 128, 1)
    assert len(ex.compiled.groups[gi].nodes) == 3 and time_group(ex, raw, gi, 2) > 0


def test_gantt_png(tmp_path):
    from recforge.rap.planning.gantt import save_png
    from recforge.rap.planning.schedule import whole_kernel_schedule
    from recforge.rap.profiling.stages import STAGES

    compiled = compile_plan(load_plan("plan0"), method="greedy")
    sched = whole_kernel_schedule(compiled, "allreduce", {g.name: 0.1 for g in compiled.groups})
    path = save_png(sched, dict.fromkeys(STAGES, 1.0), dict.fromkeys(STAGES, 0.3), tmp_path / "g.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
