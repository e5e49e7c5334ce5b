"""`recforge bench interaction` at a tiny size: every side agrees with torchrec's values and is timed, the report
has medians and ratios; bad arguments are refused."""
from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("interaction")


def test_small_run_reports_every_side(bench, tmp_path):
    out = tmp_path / "r.json"
    rc = bench.main(["--batch", "9", "--features", "3", "--dim", "5", "--rounds", "2", "--calls", "3",
                     "--sides", "torchrec,recforge_torch,recforge_cpp", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["disagree"] == {}
    assert set(report["median"]) == {"torchrec", "recforge_torch", "recforge_cpp"}
    assert len(report["rounds"]) == 2
    assert report["speedup_vs_torchrec"]["torchrec"] == pytest.approx(1.0)
    for m in report["median"].values():
        assert 0 < m["forward_s"] and 0 < m["backward_s"] and m["total_s"] > 0


def test_bad_arguments_are_refused(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--sides", "torchrec,nope", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        bench.main(["--batch", "0", "--out", str(tmp_path / "x.json")])
