"""bench/bench_accuracy.py's logic: overrides onto the defaults, the gap to the ceiling, the report and plot it
writes, and the refusal of points the machine cannot hold (before anything runs). The pipeline itself is exercised
by the integration tests; here one point's run is replaced by a recorded result."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("accuracy")


def test_overrides_land_on_the_defaults_and_bad_ones_are_named(bench):
    cfg = bench.point_config(300_000, bench.parse_overrides("train.embedding_lr=0.2,table_cap=5000"))
    assert (cfg.rows_per_day, cfg.train.embedding_lr, cfg.table_cap) == (300_000, 0.2, 5000)
    assert cfg.train.dense_lr == bench.PipelineConfig().train.dense_lr  # untouched fields keep their defaults
    lists = bench.parse_overrides("model.embedding_dim=8;model.dense_arch=[32, 8]")
    assert bench.point_config(1000, lists).model.dense_arch == [32, 8]
    configs = bench.parse_configs("base:;fast:train.dense_lr=0.01,train.epochs=2")
    assert configs == {"base": {}, "fast": {"train": {"dense_lr": 0.01, "epochs": 2}}}
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        bench.parse_overrides("train.dense_lr")
    with pytest.raises(ValueError, match="embedding_lr"):
        bench.point_config(1000, {"train": {"embedding_lr": -1}})


def test_gap_is_ceiling_minus_auc_against_the_goal(bench):
    near = bench.gap_fields(0.785, 0.79)
    assert near["gap"] == pytest.approx(0.005) and near["within_goal"] is True
    assert near["lift_reached"] == pytest.approx(0.285 / 0.29)
    far = bench.gap_fields(0.76, 0.79)
    assert far["gap"] == pytest.approx(0.03) and far["within_goal"] is False
    assert bench.gap_fields(0.7, None) == {"gap": None, "lift_reached": None, "within_goal": None}


def test_needs_grow_with_rows_and_tables(bench):
    small = bench.needs(bench.point_config(100_000, {}))
    big = bench.needs(bench.point_config(2_400_000, {}))
    wide = bench.needs(bench.point_config(100_000, {"table_cap": 1_000_000}))
    assert big["disk_bytes"] == 24 * small["disk_bytes"]
    assert big["memory_bytes"] > small["memory_bytes"] and wide["memory_bytes"] > small["memory_bytes"]


def test_refusal_names_the_limit(bench):
    cfg = bench.point_config(2_400_000, {})
    gib = 2**30
    assert bench.refusal(cfg, 64 * gib, 500 * gib, 2) is None
    memory = bench.refusal(cfg, gib, 500 * gib, 2)
    assert memory is not None and "memory" in memory and "psutil.virtual_memory" in memory
    disk = bench.refusal(cfg, 64 * gib, gib // 4, 2)
    assert disk is not None and "disk" in disk and "GiB is free" in disk
    cores = bench.refusal(bench.point_config(1000, {"resources": {"workers": 4}}), 64 * gib, 500 * gib, 2)
    assert cores is not None and "4 cores" in cores and "os.cpu_count" in cores


def test_main_refuses_tables_beyond_memory_before_anything_runs(bench, tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(bench, "run_point", lambda *a: started.append(a))
    out = tmp_path / "report.json"
    code = bench.main(["--rows", "100000", "--set", "table_cap=2000000000;model.embedding_dim=512;"
                       "model.dense_arch=[64, 512]", "--home", str(tmp_path / "h"), "--out", str(out),
                       "--plot", str(tmp_path / "a.png")])
    assert code == 2 and not started and not out.exists()
    assert "GiB of memory" in capsys.readouterr().out


def test_report_and_plot_shape(bench, tmp_path, monkeypatch):
    """Each point runs once per config, the first config's data is reused by the next, the report has the curve."""
    calls = []

    def fake_point(home, key, cfg, data_from):
        calls.append((key, cfg.train.dense_lr, data_from))
        auc = 0.70 + cfg.rows_per_day / 1e7
        return {"rows": cfg.rows_per_day, "train_rows": cfg.rows_per_day, "auc": auc, "ceiling": 0.79,
                **bench.gap_fields(auc, 0.79), "logloss": 0.45, "train_wall_s": 1.0}

    monkeypatch.setattr(bench, "run_point", fake_point)
    out, png = tmp_path / "report.json", tmp_path / "accuracy.png"
    code = bench.main(["--rows", "1000,3000", "--configs", "base:;hot:train.dense_lr=0.01", "--no-plan-ceiling",
                       "--home", str(tmp_path / "h"), "--out", str(out), "--plot", str(png)])
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["curves"]) == {"base", "hot"}
    assert [p["rows"] for p in report["curves"]["hot"]] == [1000, 3000]
    assert report["curves"]["base"][1]["gap"] == pytest.approx(0.79 - 0.7003)
    assert {"cpu_model", "loadavg_start", "loadavg_end", "defaults", "configs"} <= set(report)
    assert report["configs"]["hot"] == {"train": {"dense_lr": 0.01}}
    default = bench.PipelineConfig().train.dense_lr
    assert [c[1] for c in calls] == [default, 0.01, default, 0.01]
    assert calls[0][2] is None and calls[1][2] is not None and calls[1][2].name == calls[0][0]
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_schema_plan_ceiling_is_below_bayes(bench):
    """Missing counts and counts <= 0 look alike after fill_null(0) + log1p: the plan's ceiling is lower."""
    out = bench.schema_plan_ceiling(bench.point_config(100_000, {}), sample_rows=20_000)
    assert 0.7 < out["schema_plan_ceiling"] < out["bayes_auc_sample"] < 0.85


def test_the_ablation_plan_drops_the_default_plans_missing_indicators(bench, tmp_path):
    from recforge.preprocess.planning.plan import Plan, schema_plan

    cfg = bench.point_config(1000, {"table_cap": 5000})
    default = [f.name for f in schema_plan(cfg.dataset(), cfg.table_cap).features]
    ablation = [f.name for f in Plan.load(bench.no_indicator_plan(cfg, tmp_path / "plan.json")).features]
    assert [n for n in default if n.endswith("_missing")] == [f"I{i}_missing" for i in range(1, 14)]
    assert ablation == [n for n in default if not n.endswith("_missing")] and len(ablation) == 13 + 26
