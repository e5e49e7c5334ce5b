"""recforge.pipelines.summary over runs recorded the way the stages record them (tests/unit/ui_run_fixtures.py): per
system what it decided, did and measured, a system the run did not use said in words, and a failed run told from
one in progress. MLflow's part of the facts (run states, errors, metrics) is given directly here; test_ui_page.py
reads it from a real store."""
import pytest

from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import PlanOutputs
from recforge.pipelines.summary import (
    PIPELINE,
    RAP_MEASURED,
    RunFacts,
    StageRun,
    read_outputs,
    run_status,
    summary_of,
)
from ui_run_fixtures import CORUN, FAILED, INLINE, RUNNING, TRAIN_ERROR, corun_run, inline_run, stopped_at_train


def _facts(tmp_path, key: str, write, **mlflow) -> RunFacts:
    ctx = RunContext.create(key, {}, home=tmp_path)
    write(ctx)
    outputs, unreadable = read_outputs(ctx)
    return RunFacts(key, outputs, unreadable, **mlflow)


def _rows(section: dict, part: str) -> dict:
    return dict(section[part])


def test_a_corun_run_shows_what_every_system_decided_did_and_measured(tmp_path):
    s = summary_of(_facts(tmp_path, CORUN, corun_run, train_metrics={RAP_MEASURED: 17.25}))
    assert s["status"] == {"state": "complete", "stage": None, "error": None, "text": "complete"}
    systems = s["systems"]
    assert list(systems) == ["rap", "dlrover", "recom", "checkpoints", "executor", "warm_start", "gate"]
    assert all(sec["state"] == "used" and sec["note"] is None for sec in systems.values())

    rap = systems["rap"]
    assert _rows(rap, "decided") == {"mode": "corun (requested: auto)", "why": "co-run 15.5 ms < inline 21.0 ms",
                                     "predicted iteration, inline (ms)": 21.0,
                                     "predicted iteration, co-run (ms)": 15.5}
    assert _rows(rap, "did")["mapping"] == "mapping MILP (optimal); tables: 6 row_wise, 20 table_wise"
    assert _rows(rap, "did")["fused kernel launches"] == 3
    # the mapping's prediction against RAP's measurement in the workers; imbalance before / after
    assert _rows(rap, "measured") == {"predicted iteration (ms)": 15.5, "measured iteration, co-run (ms)": 17.25,
                                      "mapping imbalance before": 0.42, "mapping imbalance after": 0.07}

    dl = systems["dlrover"]
    assert _rows(dl, "decided")["stage 1 plan"] == "2 worker(s) x 1 CPU, 0.75 GiB each"
    did = _rows(dl, "did")
    assert did["decisions executed"] == 1 and did["runtime: add_worker"] == "throughput below the model"
    assert did["instability: replace_straggler (not executed)"] == "rank 1 slow"
    assert did["final plan"] == "3 worker(s) x 1 CPU"
    measured = _rows(dl, "measured")
    assert measured["2 worker(s) x 1 thread(s): predicted (samples/s)"] == 4400.0
    assert measured["2 worker(s) x 1 thread(s): measured (samples/s, 3 polls)"] == 4000.0
    assert measured["2 worker(s) x 1 thread(s): predicted / measured"] == 1.1
    assert measured["3 worker(s) x 1 thread(s): measured (samples/s, 4 polls)"] == 5200.0
    assert measured["peak memory per worker, predicted (GiB)"] == 1.5
    assert measured["peak memory per worker, measured max (GiB)"] == 1.25

    recom = systems["recom"]
    assert _rows(recom, "did")["embedding columns"] == 26 and _rows(recom, "did")["registered"] == "version 2"
    assert _rows(recom, "measured")["speedup vs eager"] == "4.00x"
    assert _rows(recom, "measured")["max |compiled - eager|"] == 1.5e-7

    ck = systems["checkpoints"]
    assert _rows(ck, "decided") == {"every": "10 steps", "flash checkpoints": True}
    assert _rows(ck, "did") == {"checkpoints taken": 3, "train task attempts resumed": 1, "resumed from step": 20,
                                "worker-group restarts": 1}
    assert _rows(ck, "measured") == {"time blocked on saves (s)": 0.05, "overhead (share of training time)": "2.50 %",
                                     "rows retrained after failures": 512}

    assert _rows(systems["executor"], "did") == {"path that ran": "cpp_per_group",
                                                 "C++ kernels loaded and ran": True, "groups run": 3}
    assert _rows(systems["warm_start"], "did") == {"started from": "champion version 3"}

    gate = systems["gate"]
    assert _rows(gate, "measured") == {"challenger AUC": 0.72, "champion AUC, same held-out day (version 3)": 0.70,
                                       "challenger - champion": 0.02, "held-out rows evaluated": 3000}
    assert _rows(gate, "decided")["promoted to champion"] is True
    assert s["results"]["holdout_auc"] == 0.72 and s["results"]["compile_speedup"] == 4.0


def test_systems_a_run_did_not_use_say_so_in_words(tmp_path):
    s = summary_of(_facts(tmp_path, INLINE, inline_run, params={"resources.policy": "static"}))
    systems = s["systems"]
    states = {k: sec["state"] for k, sec in systems.items()}
    assert states == {"rap": "not used", "dlrover": "not used", "recom": "used", "checkpoints": "not used",
                      "executor": "used", "warm_start": "not used", "gate": "used"}
    for key, sec in systems.items():
        if sec["state"] == "not used":
            assert sec["note"] and len(sec["note"].split()) >= 5, key  # a sentence, not a blank
    assert systems["rap"]["note"] == ("co-run not used: the workers preprocessed inline, as auto chose from RAP's "
                                      "predictions")
    assert _rows(systems["rap"], "decided")["why"] == "inline 9.0 ms <= co-run 11.0 ms: nothing to hide behind"
    # the decision still shows both predictions, and the chosen mode's prediction against the measured step time
    assert _rows(systems["rap"], "decided")["predicted iteration, co-run (ms)"] == 11.0
    assert _rows(systems["rap"], "measured") == {"predicted iteration (ms)": 9.0,
                                                 "measured step time, wall time / steps (ms)": 10.0}
    assert systems["dlrover"]["note"] == ("not used (resources.policy=static): the job ran the configured plan, "
                                          "1 worker(s) x 2 thread(s)")
    assert systems["checkpoints"]["note"].startswith("checkpoints off")
    assert systems["warm_start"]["note"] == "trained from scratch: warm_start is 'scratch'"
    assert _rows(systems["gate"], "measured")["champion AUC"] == "no champion yet"
    assert _rows(systems["recom"], "did")["registered"].startswith("not registered")


def test_a_failed_stage_is_failed_with_its_error_not_running(tmp_path):
    failed = _facts(tmp_path, FAILED, stopped_at_train,
                    runs={"train": StageRun("FAILED", TRAIN_ERROR), PIPELINE: StageRun("FAILED", "stage train failed")})
    s = summary_of(failed)
    assert s["status"] == {"state": "failed", "stage": "train", "error": TRAIN_ERROR,
                           "text": f"failed at train: {TRAIN_ERROR}"}
    assert s["systems"]["rap"]["state"] == "used"  # plan_resources ran: its decision shows
    for key in ("checkpoints", "executor", "warm_start", "recom", "gate"):
        sec = s["systems"][key]
        assert sec["state"] == "not run" and sec["note"].startswith("not run: the run failed at train"), key
    # the parent run alone (the stage's own run gone) still names the stage and the error
    parent_only = RunFacts(FAILED, failed.outputs, runs={PIPELINE: StageRun("FAILED", "stage train failed: x",
                                                                             failed_stage="train")})
    assert run_status(parent_only)["text"] == "failed at train: stage train failed: x"


def test_a_stage_in_progress_is_running_not_failed(tmp_path):
    running = _facts(tmp_path, RUNNING, stopped_at_train,
                     runs={"train": StageRun("RUNNING"), PIPELINE: StageRun("RUNNING")})
    s = summary_of(running)
    assert s["status"] == {"state": "running", "stage": "train", "error": None, "text": "running: train"}
    assert {sec["state"] for k, sec in s["systems"].items() if k not in ("rap", "dlrover")} == {"not yet"}
    # a retry after a failed attempt runs; the earlier error is mentioned, not the state
    retry = RunFacts(RUNNING, running.outputs, runs={"train": StageRun("RUNNING", error=TRAIN_ERROR)})
    assert run_status(retry)["state"] == "running" and TRAIN_ERROR in run_status(retry)["text"]
    # between tasks: no stage run open, the parent still is
    between = RunFacts(RUNNING, running.outputs, runs={PIPELINE: StageRun("RUNNING")})
    assert run_status(between) == {"state": "running", "stage": "train", "error": None,
                                   "text": "running: 3/7 stages, next train"}
    # nothing known from MLflow: neither failed nor running
    assert run_status(RunFacts(RUNNING, running.outputs))["state"] == "incomplete"


def test_unreadable_outputs_are_a_problem_not_a_crash(tmp_path):
    ctx = RunContext.create("odd", {}, home=tmp_path)
    stopped_at_train(ctx)
    (ctx.stage_dir("plan_resources") / "outputs.json").write_text('{"workers": "two"}')
    outputs, unreadable = read_outputs(ctx)
    s = summary_of(RunFacts("odd", outputs, unreadable))
    assert s["status"]["state"] == "failed" and s["status"]["stage"] == "plan_resources"
    assert "does not hold PlanOutputs" in s["problems"][0] and "workers" in s["problems"][0]
    assert s["systems"]["rap"]["note"].startswith("not run: the run failed at plan_resources")
    assert PlanOutputs.stage not in outputs


@pytest.mark.parametrize("name", ["ERROR_TAG", "FAILED_STAGE_TAG"])
def test_the_summary_reads_the_tags_tracking_writes(name):
    from recforge.pipelines import summary
    from recforge.tracking import store

    assert getattr(summary, name) == getattr(store, name)
    assert summary.PIPELINE == store.PARENT_STAGE
