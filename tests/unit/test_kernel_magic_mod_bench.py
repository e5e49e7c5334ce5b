"""bench/bench_kernel_limits.py's logic: refusal before anything runs, the op-mix roofline, and the report's shape on
a tiny run (no timing is asserted)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("kernel_limits")


def test_refuses_what_memory_cannot_hold_before_starting(bench, monkeypatch):
    args = bench.parse_args(["--stream-mib", str(10**9)])
    with pytest.raises(bench.Refused, match=r"available \(psutil.virtual_memory\(\).available"):
        bench.check_config(args)
    with pytest.raises(SystemExit, match="refused: needs"):  # main refuses before the progress bar or any build
        monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("ran a refused configuration"))
        bench.main(["--stream-mib", str(10**9)])


@pytest.mark.parametrize("argv, words", [(["--plans", "plan9"], "unknown plans"), (["--rounds", "0"], "--rounds"),
                                         (["--micro-values", "2"], "--micro-values")])
def test_refuses_bad_sizes_and_plans(bench, argv, words):
    with pytest.raises(bench.Refused, match=words):
        bench.check_config(bench.parse_args(argv))


def test_op_mix_limit_is_a_roofline(bench):
    micro = {"hash_magic_mod": {"w": 100e6}, "logit_float64": {"w": 50e6}, "clamp_int64": {"w": 1e9}}
    mix = {"hash": 10, "float64_log": 5, "fill": 10, "other": 0, "bytes_per_row": 100}
    compute = 10 / 100e6 + 5 / 50e6 + 10 / 1e9
    lim = bench.op_mix_limit(mix, micro, 1e12, "w")
    assert lim["bound"] == "compute" and lim["limit_rows_per_s"] == pytest.approx(1 / compute)
    lim = bench.op_mix_limit(mix, micro, 1e8, "w")  # 100 B/row at 0.1 GB/s: 1 us/row, memory binds
    assert lim["bound"] == "memory" and lim["limit_rows_per_s"] == pytest.approx(1e6)


def test_tiny_run_reports_every_measure(bench):
    from recforge_kernels import cpu_ext

    if not cpu_ext.load():
        pytest.skip(f"C++ extension not built: {cpu_ext.status()}")
    args = bench.parse_args(["--plans", "plan0", "--batch", "64", "--rounds", "2", "--stream-mib", "1",
                             "--micro-values", "64", "--micro-work", "64"])
    report = bench.run(args)
    assert report["settings"]["threads"] == 1 and len(report["machine"]["load_average_before"]) == 3
    assert set(report["micro_values_per_s"]) == set(bench.MICRO)
    assert report["stream"]["copy_bytes_per_s"]["rounds"] == 2
    plan0 = report["plans"]["plan0"]
    # RAP plan 0: 26 hashed sparse features, 13 logit dense ones, 1 bucketized derived feature
    assert plan0["op_mix"]["hash"] == 26 and plan0["op_mix"]["float64_log"] == 13 and plan0["op_mix"]["features"] == 40
    for key in ("per_wall_s", "per_cpu_s"):
        lim = plan0[f"limit_{key}"]
        assert lim["limit_rows_per_s"] > 0 and lim["limit_over_rows"] > 0 and lim["bound"] in ("compute", "memory")
    assert isinstance(report["goals"]["plan0_meets_15M_wall"], bool)
