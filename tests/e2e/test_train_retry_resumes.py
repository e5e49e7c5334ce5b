"""An Airflow retry of `train` resumes: trigger recforge_daily on the live services (tiny data, 2 workers, a step
checkpoint every 20 steps), SIGKILL the train task's process once a checkpoint exists, and let Airflow retry it;
meanwhile the scheduler itself is killed and restarted (while the task awaits its retry): the retry still runs.

Checked: the killed attempt's workers die with it (no orphan overlaps the retry); the retry resumes from the
checkpoint (resumed_from_step > 0, one resume, in outputs.json and the MLflow run); the final model's lineage holds
every training row exactly once (the ledger); the MLflow train_loss history has no step twice; the retry's task log
shows the workers' per-step progress; steps / world_size / batch_size are params, not metrics. The AUC is compared
with an undisturbed training of the same data (the same train and evaluate stage functions, in a subprocess, in a
sibling run dir that reuses the run's data and plan): a second whole DAG run would cost twice the time. That
reference starts as soon as the run's plan_resources is committed and trains while the DAG run trains, is killed,
waits for its retry and evaluates (the suite's time: it used to run after the DAG run, ~35 s on 2 cores).
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from e2e_services import DAG_ID, REPO, artifacts_dir, services
from recforge.data.manifest import shard_rows_from_manifest
from recforge.pipelines.context import run_key_from
from recforge.pipelines.outputs import EvaluateOutputs, IngestOutputs, TrainOutputs
from recforge.train.loop.ledger import audit

pytestmark = pytest.mark.slow

# ~190 steps per epoch at 2 x 16 rows: long enough to kill after the step-20 checkpoint, short enough to be cheap
# source_uri None: synthetic days of rows_per_day rows (not the landing zone's smaller days)
CONF = {"rows_per_day": 6000, "batch_size": 16, "table_cap": 5000, "workers": 2, "checkpoint_every_steps": 20,
        "resources_policy": "static", "preprocessing": "inline", "source_uri": None,
        "compile_backend": "export"}  # the subject is training's retry, not RECom's C++ build


# The undisturbed reference: the run's generate / ingest / plan_resources copied into a sibling run dir, then the
# train and evaluate stage functions, as the DAG's tasks call them; its AUC and train stage seconds to a JSON file.
_REFERENCE = """
import json, shutil, sys, time
from pathlib import Path
from recforge.pipelines.context import RunContext
from recforge.pipelines.dag_tasks import config_from_params
from recforge.pipelines.stages.evaluate import evaluate
from recforge.pipelines.stages.train import train

a = json.loads(sys.argv[1])
run_dir = Path(a["run_dir"])
ref = RunContext.create(a["key"], config_from_params(a["conf"]), home=Path(a["home"]), tracking_uri=a["mlflow"])
for stage in ("generate", "ingest", "plan_resources"):
    shutil.copytree(run_dir / stage, ref.stage_dir(stage))
t = time.monotonic()
out = train(ref)
train_s = time.monotonic() - t
Path(a["result"]).write_text(json.dumps({"auc": evaluate(ref).auc, "train_s": train_s,
                                         "resumed_from_step": out.checkpoints.resumed_from_step}))
"""


def _start_reference(live, key: str, conf: dict, run_dir: Path) -> tuple[subprocess.Popen, Path, Path]:
    """The undisturbed training of the run's data in a subprocess (its log in the artifacts); once the run's
    plan_resources is committed."""
    result, log = artifacts_dir() / "train_retry_reference.json", artifacts_dir() / "train_retry_reference.log"
    result.unlink(missing_ok=True)
    args = {"key": f"{key}_undisturbed", "conf": conf, "home": str(live.home), "mlflow": live.mlflow_url,
            "run_dir": str(run_dir), "result": str(result)}
    env = {**os.environ, "RECFORGE_HOME": str(live.home), "MLFLOW_TRACKING_URI": live.mlflow_url}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _REFERENCE, json.dumps(args)], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, result, log


def _checkpointed(work) -> bool:
    events = work / "events.jsonl"
    return events.exists() and '"event": "checkpoint"' in events.read_text()


def _wait_for_task(live, run_id: str, task_id: str, timeout: float) -> None:
    """Until `task_id` of the run succeeded (the later tasks, compile and publish, are not this test's subject)."""
    deadline = time.monotonic() + timeout
    while True:
        live.keep_foreign_runs_off()
        r = live.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}")
        if r.status_code == 401:  # token expired
            live.login()
            continue
        state = r.json().get("state") if r.status_code == 200 else None
        if state == "success":
            return
        assert state not in ("failed", "upstream_failed") and time.monotonic() < deadline, \
            f"{task_id} is {state} after {timeout}s\n{live.describe(run_id)}"
        time.sleep(2)


def _restart_scheduler_while_train_awaits_its_retry(live, run_id: str) -> float:
    """The scheduler restarted mid-run (fault matrix), without another DAG run: once the killed try is recorded
    (up_for_retry), SIGKILL the scheduler's process group and start it again (services.sh up starts only what is
    missing); the retry must still run under the new scheduler. Seconds the restart took."""
    deadline = time.monotonic() + 120
    while True:
        r = live.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train")
        if r.status_code == 401:
            live.login()
            continue
        state = r.json().get("state") if r.status_code == 200 else None
        if state == "up_for_retry":
            break
        assert state in (None, "running") and time.monotonic() < deadline, \
            f"train is {state}, not up_for_retry, after the kill\n{live.describe(run_id)}"
        time.sleep(0.1)
    t0 = time.monotonic()
    pid = int((live.home / "run" / "scheduler.pid").read_text())
    # within the retry delay (6 s, tests/e2e/conftest.py; this takes well under a second): the old scheduler never
    # starts the retry
    os.killpg(pid, signal.SIGKILL)
    try:
        psutil.wait_procs([psutil.Process(pid)], timeout=30)
    except psutil.NoSuchProcess:
        pass
    up = services("up", live.env)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    return time.monotonic() - t0


def _tries(live, run_id: str) -> list[dict]:
    r = live.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train/tries")
    r.raise_for_status()
    return r.json()["task_instances"]


def test_a_killed_train_task_is_retried_and_resumes_from_its_checkpoint(live):
    run_id = f"e2e_resume_{uuid.uuid4().hex[:8]}"
    conf = {**CONF, "seed": int(time.time()) % 100_000}
    t0 = time.monotonic()
    r = live.trigger(run_id, conf)
    assert r.status_code == 200, r.text
    key = run_key_from(run_id)
    run_dir = live.home / "runs" / DAG_ID / key
    work = run_dir / ".train.work"
    reference: list[tuple[subprocess.Popen, Path, Path]] = []  # started once the run's plan is committed
    try:
        _retry_and_check(live, run_id, conf, key, run_dir, work, t0, reference)
    finally:
        for proc, _, _ in reference:
            if proc.poll() is None:  # the test failed before it waited for it
                proc.kill()
                proc.wait()


def _retry_and_check(live, run_id: str, conf: dict, key: str, run_dir: Path, work: Path, t0: float,
                     reference: list[tuple[subprocess.Popen, Path, Path]]) -> None:
    deadline = time.monotonic() + 300
    while not _checkpointed(work):  # a step checkpoint exists: kill the task process now
        assert time.monotonic() < deadline, f"no step checkpoint after 300s\n{live.describe(run_id)}"
        live.keep_foreign_runs_off()  # not on every turn of this 0.3 s loop: the API server's CPU is the DAG run's
        if not reference and (run_dir / "plan_resources" / "outputs.json").exists():
            reference.append(_start_reference(live, key, conf, run_dir))
        time.sleep(0.3)
    if not reference:
        reference.append(_start_reference(live, key, conf, run_dir))
    task_pid = int((work / "task.pid").read_text())
    task = psutil.Process(task_pid)
    workers = [p for p in task.children(recursive=True)]
    assert any("torch.distributed.run" in " ".join(p.cmdline()) for p in workers), [p.cmdline() for p in workers]
    killed_at = time.monotonic()
    os.kill(task_pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, f"orphans of the killed task: {[(p.pid, p.cmdline()) for p in alive]}"
    scheduler_restart_s = _restart_scheduler_while_train_awaits_its_retry(live, run_id)

    _wait_for_task(live, run_id, "evaluate", timeout=900)
    total_s = time.monotonic() - t0
    tries = _tries(live, run_id)
    assert [t["state"] for t in tries] == ["failed", "success"], tries

    train = TrainOutputs.model_validate_json((run_dir / "train" / "outputs.json").read_text())
    ck = train.checkpoints
    assert ck is not None and ck.every_steps == 20 and ck.flash
    assert ck.resumed_from_step is not None and ck.resumed_from_step >= 20 and ck.resumes == 1
    assert ck.taken >= 2 and ck.overhead_s > 0
    assert not work.exists()  # committed: the work dir is gone, its evidence copied into the stage dir

    # lineage: every training row exactly once in the final model (the ledger the workers kept)
    ingest = IngestOutputs.model_validate_json((run_dir / "ingest" / "outputs.json").read_text())
    rows = sum(shard_rows_from_manifest(ingest.train.manifest_dir))
    lineage = audit(run_dir / "train" / "job" / "ledger")
    assert set(lineage.lineage.values()) == {1} and len(lineage.lineage) == rows
    assert sum(lineage.redone.values()) == ck.rows_retrained

    # MLflow: the record, params not metrics, no step of train_loss twice
    exp = live.mlflow("GET", "experiments/get-by-name", params={"experiment_name": DAG_ID})["experiment"]
    runs = live.mlflow("POST", "runs/search", json={
        "experiment_ids": [exp["experiment_id"]],
        "filter": f"tags.`recforge.run_key` = '{key}' and tags.`recforge.stage` = 'train'"})["runs"]
    assert len(runs) == 1
    mrun = runs[0]
    metrics = {m["key"]: m["value"] for m in mrun["data"]["metrics"]}
    params = {p["key"]: p["value"] for p in mrun["data"]["params"]}
    assert metrics["resumed_from_step"] == ck.resumed_from_step and metrics["resumes"] == 1
    assert metrics["checkpoints_taken"] == ck.taken
    assert {"steps", "world_size", "batch_size"} <= set(params) and not {"steps", "world_size", "batch_size"} & set(
        metrics)
    history = live.mlflow("GET", "metrics/get-history", params={"run_id": mrun["info"]["run_id"],
                                                                 "metric_key": "train_loss"})["metrics"]
    steps = [m["step"] for m in history]
    assert steps and len(steps) == len(set(steps)), sorted(steps)

    # the retry's task log shows the workers' per-step progress
    r = live.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/train/logs/2",
                 headers={"Accept": "application/json"})
    assert r.status_code == 200, r.text[:500]
    events = [str(c.get("event", "")) if isinstance(c, dict) else str(c) for c in r.json()["content"]]
    progress = [e for e in events if "rank0 INFO recforge.train.loop.step_loop: epoch 0 step" in e]
    assert progress and all(e.startswith("workers: ") for e in progress), events[-40:]

    # AUC against the same data trained undisturbed (same stage functions, same MLflow server), started meanwhile
    resumed_auc = EvaluateOutputs.model_validate_json((run_dir / "evaluate" / "outputs.json").read_text()).auc
    proc, result, log = reference[0]
    waited = time.monotonic()
    assert proc.wait(timeout=600) == 0, f"the undisturbed reference failed:\n{log.read_text()[-4000:]}"
    ref = json.loads(result.read_text())
    ref_auc, ref_train_s = ref["auc"], ref["train_s"]
    assert ref["resumed_from_step"] is None
    assert abs(resumed_auc - ref_auc) < 0.01, (resumed_auc, ref_auc)

    report = {"run_id": run_id, "total_s": total_s, "killed_after_s": killed_at - t0,
              "tries": [{k: t.get(k) for k in ("try_number", "state", "start_date", "end_date", "duration")}
                        for t in tries],
              "checkpoints": ck.model_dump(mode="json"), "undisturbed_train_stage_s": ref_train_s,
              "auc_resumed": resumed_auc, "auc_undisturbed": ref_auc, "scheduler_restart_s": scheduler_restart_s,
              "waited_for_the_reference_s": time.monotonic() - waited,
              "lineage_exactly_once": True}
    durations = [t.get("duration") or 0.0 for t in tries]
    # both tries of the task against one undisturbed stage run (the three ran side by side: indicative only)
    report["time_lost_s"] = sum(durations) - ref_train_s
    (artifacts_dir() / "train_retry_resumes.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))
