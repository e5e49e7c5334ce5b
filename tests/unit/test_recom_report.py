"""recforge.recom.report: latency medians and the compile report (no timing thresholds: only structure
and relations that hold by construction)."""
from __future__ import annotations

import json

import pytest
import torch

import recforge.recom as recom
from recforge.recom.report import compile_report, fixed_threads, measure_latency, take_rows
from test_recom_fixtures import build_inference, raw_batch, small_dataset


def test_measure_latency_calls_and_orders():
    calls = []
    stats = measure_latency(lambda x: calls.append(x), (1,), repeats=9, warmup=3)
    assert len(calls) == 12
    assert stats["repeats"] == 9 and stats["warmup"] == 3
    assert 0 <= stats["min_ms"] <= stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"]
    with pytest.raises(ValueError):
        measure_latency(lambda: None, (), repeats=0)


def test_fixed_threads_restores():
    before = torch.get_num_threads()
    with fixed_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError):
        with fixed_threads(0):
            pass


def test_take_rows_tiles_cyclically():
    x = torch.arange(3).reshape(3, 1)
    (y,) = take_rows((x,), 7)
    assert y.flatten().tolist() == [0, 1, 2, 0, 1, 2, 0]
    (z,) = take_rows((x,), 2)
    assert z.flatten().tolist() == [0, 1]


def test_compile_report_fields():
    ds = small_dataset()
    eager = build_inference("dlrm", dataset=ds)
    compiled = recom.compile(eager, raw_batch(ds, 16, seed=0), backend="export")
    heldout = raw_batch(ds, 100, seed=42)
    threads = torch.get_num_threads()
    rep = compile_report(eager, compiled, heldout, batch_size=32, repeats=5, warmup=1, threads=1)
    assert torch.get_num_threads() == threads
    json.dumps(rep)  # JSON-able
    assert rep["num_columns"] == rep["num_tables"] == len(ds.sparse)
    assert rep["lookups_eager"] == rep["lookups_compiled"] == len(ds.sparse)
    assert rep["ops_compiled"] < rep["ops_eager"]
    assert rep["heldout_rows"] == 100 and rep["within_tolerance"] and rep["max_abs_diff"] <= 1e-5
    assert rep["latency"]["batch_size"] == 32 and rep["latency"]["threads"] == 1
    assert rep["speedup"] == pytest.approx(rep["eager_median_ms"] / rep["compiled_median_ms"])
    assert rep["backend"] == rep["requested_backend"] == "export" and "backend_fallback" not in rep


def test_compile_report_records_a_fallback_from_auto():
    """No C++ compiler: 'auto' runs the exported graph, and the report says what was asked, what ran and why."""
    import torch._inductor.config as inductor_config

    ds = small_dataset()
    eager = build_inference("dlrm", dataset=ds)
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/bin/c++",)}), pytest.warns(UserWarning, match="AOTInd"):
        compiled = recom.compile(eager, raw_batch(ds, 16, seed=0), backend="auto")
    rep = compile_report(eager, compiled, raw_batch(ds, 32, seed=1), batch_size=16, repeats=2, warmup=1, threads=1)
    assert (rep["requested_backend"], rep["backend"]) == ("auto", "export") and rep["within_tolerance"]
    assert rep["backend_fallback"], rep


def test_compile_report_strict_raises_on_mismatch():
    ds = small_dataset()
    eager = build_inference("dlrm", dataset=ds)
    other = build_inference("dlrm", dataset=ds, seed=1)  # different weights
    compiled = recom.compile(other, raw_batch(ds, 16, seed=0), backend="export")
    heldout = raw_batch(ds, 50, seed=3)
    with pytest.raises(recom.CompileMismatchError):
        compile_report(eager, compiled, heldout, repeats=1, warmup=0)
    rep = compile_report(eager, compiled, heldout, repeats=1, warmup=0, strict=False)
    assert not rep["within_tolerance"] and rep["max_abs_diff"] > 1e-5


def test_compile_report_on_a_column_model():
    from recforge.recom.family import FamilySpec, build_model, make_features

    m = build_model(FamilySpec(bucketized=2, int_hash=1, string_hash=1, multi_hot=2, large_multi_hot=0,
                               num_dense=3, bottom=(4,), top=(8,)))
    compiled = recom.compile(m, (make_features(m, 8, seed=0),), backend="export")
    rep = compile_report(m, compiled, (make_features(m, 40, seed=1),), batch_size=16, repeats=2, warmup=0)
    assert rep["within_tolerance"] and rep["heldout_rows"] == 40 and rep["latency"]["batch_size"] == 16
    (rows,) = take_rows((make_features(m, 5, seed=2),), 12)
    assert rows["dense"].shape[0] == 12 and rows["multi_hot_0_lengths"].shape[0] == 12
