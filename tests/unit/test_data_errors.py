"""Errors a data engineer can act on: a DataError is one line, classified as a data error (not a code error) in the
CLI (exit 2, no traceback), the Airflow task log (`DATA ERROR:` first, not retried), MLflow
(recforge.error_kind = data) and the elastic failover (not relaunched, not called a code error)."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from recforge.cli import app
from recforge.config import PipelineConfig
from recforge.data.errors import DataError
from recforge.elastic.master.failover import FailoverPolicy, Failure, read_records, record_exception
from recforge.pipelines.context import EXPERIMENT, RunContext, StageWriter
from recforge.pipelines.dag_tasks import run_stage_from_context
from recforge.pipelines.outputs import GenerateOutputs
from recforge.pipelines.stage import failure_kind, run_stage
from recforge.tracking.store import ERROR_KIND_TAG, ERROR_TAG, PARENT_STAGE, RETRY_TAG, TrackingStore

BAD = DataError("value 'x' is not an integer", path="/landing/day_3.csv", row=17, column="price")


def test_a_data_error_is_its_own_kind():
    assert failure_kind(BAD) == "data"
    assert failure_kind(ValueError("bug")) == "error"


# --- CLI ----------------------------------------------------------------------------------------------------------
def test_cli_prints_a_data_error_as_one_line_and_exits_2(tmp_path):
    empty = tmp_path / "day_0.tsv"
    empty.write_text("")
    script = Path(sys.executable).parent / "recforge"  # the console script (pyproject: recforge.cli:app)
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "recforge.cli"]
    proc = subprocess.run([*cmd, "data", "validate", str(empty), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("data error: ") and str(empty) in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_cli_keeps_other_errors_as_they_were(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="source file not found"):  # typer's handling, not a data error
        app(["data", "validate", str(tmp_path / "missing.tsv"), "--out", str(tmp_path / "out")])
    assert "data error" not in capsys.readouterr().err


# --- pipeline stages, Airflow, MLflow -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def home(module_home):
    return module_home


def _failure_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_stage_records_a_data_error_as_data_and_logs_its_line_first(home, caplog):
    ctx = RunContext.create("manual__data_error", PipelineConfig(), home=home)

    def bad(w, store, run_id):
        raise BAD

    with caplog.at_level(logging.INFO, logger="recforge.pipelines"), pytest.raises(DataError):
        run_stage(ctx, GenerateOutputs, bad)
    errors = _failure_records(caplog)
    assert errors[0] == f"DATA ERROR: {BAD.one_line()}"
    assert sum(m.startswith("DATA ERROR") for m in errors) == 1
    runs = TrackingStore().stage_runs(ctx.experiment, ctx.run_key)
    for run in (runs["generate"], runs[PARENT_STAGE]):
        assert (run.info.status, run.data.tags[ERROR_KIND_TAG]) == ("FAILED", "data")
        assert "DataError: /landing/day_3.csv" in run.data.tags[ERROR_TAG]


def test_airflow_fails_bad_data_at_once_with_data_error_first_in_the_log(home, tmp_path, caplog):
    """ingest of an empty day file: the task log's first failure line is `DATA ERROR: <file>: ...`, the task fails
    without a retry (AirflowFailException) and the MLflow runs say `data`."""
    run_id = "manual__empty_day"
    ctx = RunContext.create(run_id, PipelineConfig(), home=home)
    empty = tmp_path / "day_0.tsv"
    empty.write_text("")
    StageWriter(ctx, "generate").commit(GenerateOutputs(files=[str(empty), str(empty)], synthetic=False))
    context = {"params": {}, "dag_run": SimpleNamespace(run_id=run_id, run_after=None), "logical_date": None,
               "ti": SimpleNamespace(try_number=1, max_tries=2)}
    with caplog.at_level(logging.INFO), pytest.raises(AirflowFailException) as info:
        run_stage_from_context("ingest", context)
    assert str(info.value).startswith("DATA ERROR: ingest: ") and "not retried" in str(info.value)
    assert str(empty) in str(info.value)
    errors = _failure_records(caplog)
    assert errors[0].startswith("DATA ERROR: ") and str(empty) in errors[0] and "\n" not in errors[0]
    assert sum(m.startswith("DATA ERROR") for m in errors) == 1  # once, though two layers saw it
    runs = TrackingStore().stage_runs(EXPERIMENT, ctx.run_key)
    assert runs["ingest"].data.tags[ERROR_KIND_TAG] == "data"
    assert runs[PARENT_STAGE].data.tags[ERROR_KIND_TAG] == "data"
    assert RETRY_TAG not in runs[PARENT_STAGE].data.tags  # attempts were left, but bad data is not retried


# --- elastic failover ---------------------------------------------------------------------------------------------
def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:
        return e


def test_failover_gives_up_on_a_data_error_and_does_not_call_it_a_code_error(tmp_path):
    record_exception(tmp_path, rank=0, generation=0, exc=_raise(DataError("shard part-00003.parquet is corrupt")))
    records = read_records(tmp_path, range(0, 1))
    assert records[0].data_error and records[0].exc_type == "DataError"
    failure = Failure.from_launch(1, records, [0])
    assert failure.kind == "data"
    decision = FailoverPolicy(max_relaunches=3).decide(failure, [], restarts_used=0, batch_size=8,
                                                       grad_accumulation=1)
    assert not decision.relaunch  # a relaunch would read the same data
    assert decision.reason.startswith("data error") and "code error" not in decision.reason
    assert "part-00003.parquet" in decision.reason

    record_exception(tmp_path, rank=0, generation=1, exc=_raise(ValueError("a bug")))
    code = Failure.from_launch(1, read_records(tmp_path, range(1, 2)), [1])
    assert code.kind == "error" and FailoverPolicy().decide(code, [], restarts_used=0, batch_size=8,
                                                             grad_accumulation=1).relaunch


def test_failure_records_written_before_the_data_error_field_still_read(tmp_path):
    record_exception(tmp_path, rank=1, generation=2, exc=_raise(RuntimeError("x")))
    path = tmp_path / "gen0002-rank1.json"
    data = json.loads(path.read_text())
    del data["data_error"]
    path.write_text(json.dumps(data))
    assert read_records(tmp_path, range(2, 3))[0].data_error is False
