"""bench/bench_scale.py's logic: the RSS sampler on a real process tree, the linear fit, stage attribution, and the
refusal of sizes the machine cannot hold (before anything runs)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("scale")


ALLOCATING_TREE = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import time; b = bytearray(160 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"])
    child.wait(timeout=60)
    time.sleep(0.3)
""")


def test_the_sampler_sees_a_grandchild_that_allocates_and_its_peak(bench):
    proc = subprocess.Popen([sys.executable, "-c", ALLOCATING_TREE])
    with bench.RssSampler(proc.pid, interval_s=0.1) as sampler:
        proc.wait(timeout=60)
    roles = sampler.by_role()
    assert roles["main"]["processes"] == 1
    others = {r: v for r, v in roles.items() if r.startswith("other:")}
    assert sum(v["processes"] for v in others.values()) == 1
    peak = max(v["peak_rss_mb"] for v in others.values())
    assert 160 <= peak < 400  # the child's 160 MiB touched, seen through VmHWM/RSS
    assert roles["main"]["peak_rss_mb"] < 160
    assert max(kb for _, kb in sampler.tree_samples) / 1024 >= 160


def test_roles_from_command_lines(bench):
    py = "/usr/bin/python3"
    assert bench.classify([py, "x.py"], True) == "main"
    assert bench.classify([py, "-m", "torch.distributed.run", "--nnodes=1", "-m", "recforge.worker"],
                          False) == "torchrun"
    assert bench.classify([py, "-u", "-m", "recforge.worker", "spec.json"], False) == "train_rank"
    assert bench.classify([py, "-m", "recforge.rap.profiling.profile_ranks", "job"], False) == "rap_profile_rank"
    assert bench.classify(["/bin/sh", "-c", "true"], False) == "other:sh"


def test_linear_fit_recovers_a_line_and_needs_two_sizes(bench):
    f = bench.linear_fit([100_000, 1_000_000, 10_000_000], [12.0 + 3.5 * 0.1, 12.0 + 3.5, 12.0 + 35.0])
    assert f["slope_per_mrow"] == pytest.approx(3.5)
    assert f["intercept"] == pytest.approx(12.0)
    assert f["r2"] == pytest.approx(1.0)
    assert bench.linear_fit([100_000], [5.0])["slope_per_mrow"] is None
    noisy = bench.linear_fit([1, 2, 3, 4], [1.0, 3.0, 2.0, 4.0])
    assert 0 < noisy["r2"] < 1


def test_stage_table_splits_stats_out_of_ingest_and_attributes_children(bench):
    events = [
        {"event": "stage", "stage": "generate", "start": 0.0, "end": 10.0, "hwm_kb": 300 * 1024},
        {"event": "hwm", "stage": "ingest", "hwm_kb": 500 * 1024},
        {"event": "stage", "stage": "stats", "start": 12.0, "end": 15.0, "hwm_kb": 350 * 1024},
        {"event": "stage", "stage": "ingest", "start": 10.0, "end": 15.5, "hwm_kb": 360 * 1024},
        {"event": "start", "stage": "train", "start": 20.0, "rss_kb": 640 * 1024},
        {"event": "stage", "stage": "train", "start": 20.0, "end": 40.0, "hwm_kb": 700 * 1024},
    ]
    procs = [bench.ProcSeen(1, "main", 0.0, 40.0, 900 * 1024),
             bench.ProcSeen(2, "train_rank", 21.0, 39.0, 800 * 1024, 1000 * 1024),
             bench.ProcSeen(3, "train_rank", 21.0, 39.0, 600 * 1024, 650 * 1024),
             bench.ProcSeen(4, "torchrun", 20.5, 39.5, 100 * 1024)]
    t = bench.stage_table(events, procs, rows=500_000)
    assert t["ingest"]["seconds"] == pytest.approx(2.5)  # 5.5 s less the 3 s statistics pass
    assert t["ingest"]["peak_rss_mb"]["main"] == pytest.approx(500)  # before the statistics pass
    assert t["stats"]["seconds"] == pytest.approx(3.0)
    assert t["generate"]["s_per_mrow"] == pytest.approx(20.0)
    assert t["train"]["peak_rss_mb"] == {"main": 700, "train_rank": 1000, "torchrun": 100}
    assert set(t["generate"]["peak_rss_mb"]) == {"main"}
    # main's RSS carried into train (640 MB) and what train itself added to it (700 - 640)
    assert t["train"]["main_start_rss_mb"] == pytest.approx(640)
    assert t["train"]["main_growth_mb"] == pytest.approx(60)
    assert t["generate"]["main_growth_mb"] is None  # no start event recorded: not made up


def test_sizes_beyond_disk_or_memory_are_refused_naming_the_limit(bench, tmp_path):
    with pytest.raises(bench.Refused, match="GB of disk .* GB free"):
        bench.check_fits(10**12, tmp_path)
    with pytest.raises(bench.Refused, match="GB of memory .*psutil.virtual_memory"):
        bench.check_fits(100_000, tmp_path, free_disk=10**13, available_memory=2 * 1024**3)
    with pytest.raises(bench.Refused, match=">= 1000"):
        bench.check_fits(10, tmp_path)
    fits = bench.check_fits(100_000, tmp_path / "not" / "yet", free_disk=10**13, available_memory=10**12)
    assert fits["disk_bytes"] == bench.estimate(100_000)["disk_bytes"]


def test_main_refuses_before_running_anything(bench, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = bench.main(["--rows", "100000,1000000000000", "--work", str(tmp_path / "work"), "--out", str(out)])
    assert code == 2
    assert "refused: 1,000,000,000,000 rows per day need" in capsys.readouterr().err
    assert not out.exists() and not list((tmp_path / "work").iterdir())


def test_predicted_time_extrapolates_the_measured_sizes(bench):
    sizes = [{"rows_per_day": 100_000, "wall_s": 60.0}, {"rows_per_day": 1_000_000, "wall_s": 150.0}]
    assert bench.predicted_seconds(sizes, 10_000_000) == pytest.approx(1050.0)
    assert bench.predicted_seconds(sizes[:1], 10_000_000) is None


def test_adding_to_a_report_of_another_training_config_is_refused(bench, tmp_path):
    import json

    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"training": {"workers": 1, "epochs": 1}, "sizes": []}))
    with pytest.raises(SystemExit, match="--add-to .*not --workers 2 --epochs 1"):
        bench.main(["--rows", "100000", "--add-to", str(earlier), "--work", str(tmp_path / "w"),
                    "--out", str(tmp_path / "r.json")])
