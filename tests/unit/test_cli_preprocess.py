"""`recforge preprocess`: the pipeline's plan names and executors over a manifest, bad names rejected."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from recforge.cli import app
from recforge.config import criteo_kaggle_dataset
from recforge.data import generate_days, ingest


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cli_pre")
    days = generate_days(criteo_kaggle_dataset(), tmp / "raw", days=1, rows_per_day=600, seed=3)
    ingest([Path(f) for f in days.files], criteo_kaggle_dataset(), tmp / "m", rows_per_shard=250, max_bad_fraction=0.0)
    return tmp / "m"


@pytest.mark.parametrize("executor", ["eager", "fused"])
def test_runs_the_named_plan_and_executor_over_every_row(manifest, executor):
    out = CliRunner().invoke(app, ["preprocess", str(manifest), "--executor", executor, "--plan", "criteo",
                                   "--table-cap", "1000", "--batch-size", "128"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())  # rich wraps long lines at the terminal width
    assert f"preprocessed 600 rows with the {executor} executor" in text
    assert "(13 dense, 26 sparse features)" in text


def test_unknown_executor_and_plan_are_named(manifest):
    bad = CliRunner().invoke(app, ["preprocess", str(manifest), "--executor", "gpu-magic"])
    assert bad.exit_code != 0 and "gpu-magic" in bad.output
    missing = CliRunner().invoke(app, ["preprocess", str(manifest), "--plan", "no_such_plan"])
    assert missing.exit_code != 0
    assert "no_such_plan" in (missing.output + repr(missing.exception))
