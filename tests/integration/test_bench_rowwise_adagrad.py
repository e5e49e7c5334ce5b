"""`recforge bench rowwise_adagrad` at a tiny size: both sides end in the same state and are timed, the report has
medians and the speedup; bad arguments and a size beyond memory are refused."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("rowwise_adagrad")


def test_small_run_reports_both_sides(bench, tmp_path):
    out = tmp_path / "r.json"
    rc = bench.main(["--tables", "3", "--rows", "50", "--dim", "8", "--batch", "16", "--rounds", "2", "--calls", "3",
                     "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["median"]) == {"fbgemm", "recforge"} and len(report["rounds"]) == 2
    for m in report["median"].values():
        assert 0 < m["forward_s"] and 0 < m["backward_s"] and m["total_s"] > 0
    assert report["speedup_vs_fbgemm"]["total_s"] == pytest.approx(
        report["median"]["fbgemm"]["total_s"] / report["median"]["recforge"]["total_s"])


@pytest.mark.parametrize("args, match", [
    (["--dim", "6"], "multiple of 4"),
    (["--rows", "0"], ">= 1"),
    (["--tables", "1000", "--rows", "100000000"], "beyond 80% of the"),
])
def test_bad_arguments_are_refused_naming_them(bench, tmp_path, capsys, args, match):
    with pytest.raises(SystemExit):
        bench.main([*args, "--out", str(tmp_path / "x.json")])
    assert match in capsys.readouterr().err
