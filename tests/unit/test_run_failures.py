"""Failures are visible and final: a failed, invalid or cancelled stage ends its MLflow runs FAILED with the reason,
invalid input fails the Airflow task without a retry, and the experiment opens on its training runs (MLflow 3's
experiment kind). Against a real MLflow SQLite store."""
from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException

from recforge.config import PipelineConfig
from recforge.pipelines.context import EXPERIMENT, RunContext
from recforge.pipelines.dag_tasks import close_open_runs, run_stage_from_context
from recforge.pipelines.outputs import GenerateOutputs
from recforge.pipelines.stage import InvalidInput, StageCancelled, run_stage
from recforge.tracking.store import (
    ERROR_KIND_TAG,
    ERROR_TAG,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    FAILED_STAGE_TAG,
    PARENT_STAGE,
    RETRY_TAG,
    TrackingStore,
    error_text,
)


@pytest.fixture(scope="module")
def home(tmp_path_factory, mlflow_db):
    """One $RECFORGE_HOME and MLflow SQLite store for the module (a new store costs seconds of migrations); each
    test uses run keys and experiments of its own."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECFORGE_HOME", str(home))
        mp.setenv("MLFLOW_TRACKING_URI", mlflow_db(home / "mlflow" / "mlflow.db"))
        mp.setenv("RECFORGE_MLFLOW_ARTIFACTS", str(home / "mlflow" / "artifacts"))
        yield home


@pytest.fixture
def ctx(home, request):
    return RunContext.create(f"manual__{request.node.name}", PipelineConfig(), home=home)


def _runs(ctx):
    return TrackingStore().stage_runs(ctx.experiment, ctx.run_key)


def _ok(w, store, run_id):
    return GenerateOutputs(files=["a", "b"], synthetic=True)


def _status(run):
    return run.info.status, run.data.tags.get(ERROR_KIND_TAG), run.data.tags.get(ERROR_TAG)


def test_a_failed_stage_and_its_pipeline_end_failed_with_the_reason_and_a_retry_reopens_them(ctx):
    def boom(w, store, run_id):
        raise RuntimeError("worker group exited with code 1\nrank 0: oom")

    with pytest.raises(RuntimeError, match="worker group exited"):
        run_stage(ctx, GenerateOutputs, boom)
    runs = _runs(ctx)
    assert _status(runs["generate"]) == ("FAILED", "error",
                                         "RuntimeError: worker group exited with code 1\nrank 0: oom")
    parent = runs[PARENT_STAGE]
    assert _status(parent)[:2] == ("FAILED", "error")
    assert parent.data.tags[ERROR_TAG].startswith("stage generate failed: RuntimeError: worker group exited")
    assert parent.data.tags[FAILED_STAGE_TAG] == "generate"
    assert not (ctx.stage_dir("generate")).exists()  # nothing half-done is seen

    out = run_stage(ctx, GenerateOutputs, _ok)  # the Airflow retry: same runs, reopened, the old reason gone
    runs = _runs(ctx)
    assert out.mlflow_run_id == runs["generate"].info.run_id
    assert _status(runs["generate"]) == ("FINISHED", None, None)
    assert _status(runs[PARENT_STAGE]) == ("RUNNING", None, None)  # the pipeline goes on (publish finishes it)
    assert FAILED_STAGE_TAG not in runs[PARENT_STAGE].data.tags


def test_invalid_input_is_recorded_as_such(ctx):
    def bad(w, store, run_id):
        raise InvalidInput("source_uri /nope/day_{ds}.tsv names no file")

    with pytest.raises(InvalidInput):
        run_stage(ctx, GenerateOutputs, bad)
    assert _status(_runs(ctx)["generate"]) == (
        "FAILED", "invalid_input", "InvalidInput: source_uri /nope/day_{ds}.tsv names no file")


def test_sigterm_cancels_the_stage_and_is_recorded_distinctly(ctx):
    """Airflow 3 answers SIGTERM (task marked failed / cancelled) with on_kill() only; run_stage turns it into
    StageCancelled after calling the handler it replaced, records it, and restores that handler."""
    calls = []

    def airflow_handler(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, airflow_handler)
    try:
        def long_stage(w, store, run_id):
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the handler raises at the next bytecode; bounded regardless
                time.sleep(0.01)
            raise AssertionError("SIGTERM did not cancel the stage within 30 s")

        with pytest.raises(StageCancelled):
            run_stage(ctx, GenerateOutputs, long_stage)
        assert calls == [signal.SIGTERM]  # Airflow's own handler still ran
        assert signal.getsignal(signal.SIGTERM) is airflow_handler  # and is back in place
    finally:
        signal.signal(signal.SIGTERM, previous)
    runs = _runs(ctx)
    status, kind, error = _status(runs["generate"])
    assert (status, kind) == ("FAILED", "cancelled")
    assert error.startswith("cancelled/killed (SIGTERM)")
    assert _status(runs[PARENT_STAGE])[:2] == ("FAILED", "cancelled")


def _airflow_context(run_id, try_number=1, max_tries=1, **params):
    return {"params": params, "dag_run": SimpleNamespace(run_id=run_id, run_after=None), "logical_date": None,
            "ti": SimpleNamespace(try_number=try_number, max_tries=max_tries)}


def test_a_bad_param_fails_the_task_without_retry_and_names_it(home):
    with pytest.raises(AirflowFailException, match=r"param 'workers': must be >= 1, got 0") as info:
        run_stage_from_context("generate", _airflow_context("manual__bad", workers=0, rows_per_day=1000))
    assert "not retried" in str(info.value)
    parent = TrackingStore().stage_runs(EXPERIMENT, "manual__bad")[PARENT_STAGE]
    assert _status(parent)[:2] == ("FAILED", "invalid_input")
    assert "param 'workers': must be >= 1, got 0" in parent.data.tags[ERROR_TAG]
    assert RETRY_TAG not in parent.data.tags  # attempts left, but invalid input is not retried


def test_a_record_that_fails_its_schema_is_not_retried_a_missing_one_is(home):
    """ingest reads generate's outputs: one that does not validate cannot get better (OutputsError -> no retry);
    one that is missing is an ordinary error (FileNotFoundError: Airflow retries it)."""
    context = _airflow_context("manual__ingest", rows_per_day=1000)
    ctx = RunContext.create("manual__ingest", PipelineConfig(rows_per_day=1000), home=home)
    with pytest.raises(FileNotFoundError, match="has no recorded outputs"):
        run_stage_from_context("ingest", context)
    parent = TrackingStore().stage_runs(EXPERIMENT, ctx.run_key)[PARENT_STAGE]
    assert _status(parent)[:2] == ("FAILED", "error")
    assert parent.data.tags[RETRY_TAG] == "attempt 1 of 2 failed; Airflow retries the task"  # not final yet
    with pytest.raises(FileNotFoundError):  # the retry fails too: now it is final
        run_stage_from_context("ingest", {**context, "ti": SimpleNamespace(try_number=2, max_tries=1)})
    parent = TrackingStore().stage_runs(EXPERIMENT, ctx.run_key)[PARENT_STAGE]
    assert _status(parent)[:2] == ("FAILED", "error") and RETRY_TAG not in parent.data.tags

    ctx.stage_dir("generate").mkdir(parents=True)
    (ctx.stage_dir("generate") / "outputs.json").write_text('{"files": "not a list", "synthetic": true}')
    with pytest.raises(AirflowFailException, match=r"OutputsError: .*files") as info:
        run_stage_from_context("ingest", context)
    assert "not retried" in str(info.value)
    parent = TrackingStore().stage_runs(EXPERIMENT, ctx.run_key)[PARENT_STAGE]
    assert _status(parent)[:2] == ("FAILED", "invalid_input")
    assert parent.data.tags[FAILED_STAGE_TAG] == "ingest"


def test_the_dag_failure_callback_closes_runs_a_killed_task_left_open(ctx):
    """A SIGKILLed task process cannot close its runs; the failed DAG run's callback does, and leaves closed ones
    (with their own reasons) as they are."""
    store = TrackingStore()
    run_stage(ctx, GenerateOutputs, _ok)
    store.stage_run(ctx.experiment, ctx.run_key, "train")  # then the train task was SIGKILLed
    closed = close_open_runs({"run_id": ctx.run_key, "reason": "task_failure"})
    runs = _runs(ctx)
    assert sorted(closed) == sorted([runs["train"].info.run_id, runs[PARENT_STAGE].info.run_id])
    assert _status(runs["generate"]) == ("FINISHED", None, None)
    status, kind, error = _status(runs["train"])
    assert (status, kind) == ("FAILED", "killed") and "SIGKILL" in error and "task_failure" in error
    assert _status(runs[PARENT_STAGE])[:2] == ("FAILED", "killed")
    assert runs[PARENT_STAGE].data.tags[FAILED_STAGE_TAG] == "train"
    assert close_open_runs({"run_id": ctx.run_key}) == []  # nothing left open
    assert _status(_runs(ctx)["train"]) == (status, kind, error)


def test_error_text_keeps_the_first_lines():
    text = error_text(ValueError("\n".join(f"line {i}" for i in range(100))))
    assert text.startswith("ValueError: line 0\nline 1") and text.endswith("line 19\n...")
    assert len(error_text("x" * 10_000)) == 4000
    assert error_text(KeyError("k")) == "KeyError: 'k'"


def test_experiments_open_on_their_training_runs(home):
    """MLflow 3 shows an experiment without a kind as a GenAI one (traces); recforge's are model development."""
    store = TrackingStore()
    new = store.experiment_id("fresh")
    assert store.client.get_experiment(new).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    old = store.client.create_experiment("made_before")  # e.g. by an older recforge
    assert EXPERIMENT_KIND_TAG not in store.client.get_experiment(old).tags
    assert store.experiment_id("made_before") == old
    assert store.client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    chosen = store.client.create_experiment("user_chose", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    store.experiment_id("user_chose")
    assert store.client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"  # kept
