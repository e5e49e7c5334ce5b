"""bench_simulate --scale: the projection that skips a point past the budget, and the report's shape."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("simulate")


def test_projection_scales_by_jobs_and_carries_the_measured_growth(bench):
    assert bench.projected_s([], 1000) is None
    assert bench.projected_s([{"jobs": 1000, "sim_s": 2.0}], 10000) == pytest.approx(20.0)
    # 10x the jobs took 20x the time: the next 10x is projected at 20x again
    pts = [{"jobs": 1000, "sim_s": 2.0}, {"jobs": 10000, "sim_s": 40.0}]
    assert bench.projected_s(pts, 100000) == pytest.approx(800.0)
    # faster than linear is not extrapolated as a gain
    assert bench.projected_s([{"jobs": 1000, "sim_s": 2.0}, {"jobs": 10000, "sim_s": 10.0}], 100000) == \
        pytest.approx(100.0)
    # only smaller points count; a failed point (no sim_s) is ignored
    assert bench.projected_s([{"jobs": 1000, "sim_s": 2.0}, {"jobs": 1000, "error": "x"}], 1000) is None


def test_scale_skips_a_point_projected_past_the_budget(bench, tmp_path):
    rc = bench.main(["--scale", "--scale-jobs", "20", "40", "--scale-policies", "static", "--budget-s", "1e-9",
                     "--window-h", "6", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "simulate_scale.json").read_text())
    first, second = doc["points"]
    assert first["jobs"] == 20 and first["policy"] == "static" and first["events"] > 0 and first["sim_s"] > 0
    assert len(first["loadavg_start"]) == 3 and len(first["loadavg_end"]) == 3
    assert second["jobs"] == 40 and "sim_s" not in second and second["skipped"].startswith("projected")
    assert second["projected_s"] > 0
    assert doc["machine"]["cpu_model"] and doc["machine"]["cpus"] >= 1
