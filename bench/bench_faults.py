"""The fault matrix, measured: the training job (small sizes, 2 ranks x 1 thread, local backend, per-sample ledger)
run once undisturbed and once per fault; per fault: survived, rows lost, rows trained twice in the final model's
lineage, time lost and the AUC difference to the undisturbed run. docs/fault_tolerance.md (fault matrix) says what
each fault must do. Faults are injected from outside with recforge.pipelines.faults.

    recforge bench faults                      # every fault, 6,000 rows, MLflow down 30 s
    recforge bench faults --only worker_sigkill,checkpoint_nan --rows 4000

The Airflow faults (SIGKILL of the task process running `train`, then the scheduler restarted while the task
awaits its retry) need live Airflow + MLflow: the bench runs tests/e2e/test_train_retry_resumes.py (it starts
scripts/services.sh, injects both faults into one DAG run and checks the lineage) and folds its report into the
table; `--no-airflow` folds in an existing report instead.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform as py_platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
LOG_EVERY, CKPT_EVERY = 5, 10
FAULTS = ("worker_sigkill", "master_sigkill", "worker_sigstop", "mlflow_down", "checkpoint_random",
          "checkpoint_nan", "checkpoint_dir_full", "airflow_task_sigkill", "airflow_scheduler_restart")


def prepare(root: Path, rows: int, batch: int) -> dict[str, Any]:
    from recforge.config import ModelConfig, TrainConfig, dataset_preset
    from recforge.data.generator import generate_days
    from recforge.data.ingest import ingest
    from recforge.preprocess.planning.plan import criteo_plan

    ds = dataset_preset("criteo_kaggle")
    generate_days(ds, root / "raw", days=2, rows_per_day=rows, seed=7)
    ingest([root / "raw" / "day_0.tsv"], ds, root / "train", rows_per_shard=rows // 4, max_bad_fraction=0.01)
    ingest([root / "raw" / "day_1.tsv"], ds, root / "holdout", rows_per_shard=rows, max_bad_fraction=0.01)
    plan = criteo_plan(ds, 5000)
    plan.save(root / "plan.json")
    model = ModelConfig(embedding_dim=8, dense_arch=[32, 8], over_arch=[32, 1])
    train = TrainConfig(epochs=1, batch_size=batch, batches_per_task=4, log_every=LOG_EVERY, embedding_lr=0.05,
                        dense_lr=0.002, lease_timeout_s=600.0)
    return {"root": root, "ds": ds, "plan": plan, "model": model, "train": train, "rows": rows, "batch": batch}


def spec_for(data: dict, run: Path, **extra: Any) -> dict[str, Any]:
    recovery = {"checkpoint_every_steps": CKPT_EVERY, "ledger_dir": str(run / "ledger"), **extra.pop("recovery", {})}
    return {"manifest_dir": str(data["root"] / "train"), "plan_path": str(data["root"] / "plan.json"),
            "dataset": data["ds"].model_dump(mode="json"), "model": data["model"].model_dump(mode="json"),
            "train": data["train"].model_dump(mode="json"),
            "checkpoint_dir": str(extra.pop("checkpoint_dir", run / "ckpt")), "output_dir": str(run / "out"),
            "seed": 0, "recovery": recovery, **extra}


def run_job(data: dict, run: Path, *, max_restarts: int = 2, faults: list | None = None, resume: bool = False,
            hang_timeout_s: float | None = None, **spec_extra: Any) -> Any:
    from recforge.config import ResourceConfig
    from recforge.data.manifest import Manifest
    from recforge.elastic.backends.local import LocalBackend
    from recforge.elastic.job import run_training_job
    from recforge.elastic.master.failover import FailoverPolicy
    from recforge.elastic.policy import StaticPolicy

    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=max_restarts)
    env = {"RECFORGE_FAULTS": json.dumps(faults)} if faults else {}
    backend = LocalBackend(max_restarts=0, log_dir=run / "job", env=env, monitor_interval_s=0.5)
    kw: dict[str, Any] = {}
    if hang_timeout_s is not None:
        kw["failover"] = FailoverPolicy(max_relaunches=max_restarts, hang_timeout_s=hang_timeout_s)
    return run_training_job(spec_for(data, run, **spec_extra), [s.rows for s in Manifest.load(data["root"] /
                            "train").shards], resources=res, state_dir=run / "job",
                            policy=StaticPolicy(res, cpu_count=2), backend=backend, resume=resume, timeout_s=900,
                            poll_s=0.2, **kw)


# ---- what a run left -------------------------------------------------------------------------------------
def lineage(data: dict, run: Path) -> dict[str, int]:
    from recforge.data.manifest import Manifest
    from recforge.train.loop.ledger import audit

    expected = {(0, s, r) for s, info in enumerate(Manifest.load(data["root"] / "train").shards)
                for r in range(info.rows)}
    a = audit(run / "ledger")
    return {"rows_lost": len(expected - set(a.lineage)),
            "rows_twice_in_lineage": sum(1 for k, n in a.lineage.items() if n > 1 or k not in expected),
            "rows_retrained_outside_lineage": int(sum(a.redone.values()))}


def auc(data: dict, ckpt: Path) -> float:
    from recforge.preprocess.executor import TorchExecutor
    from recforge.train.metrics import evaluate
    from recforge.train.recovery.checkpoint import load_unsharded

    plan = data["plan"]
    model = load_unsharded(data["model"], plan.tables(), len(plan.dense_features()), ckpt)
    return float(evaluate(model, TorchExecutor(plan, data["ds"]), data["root"] / "holdout", batch_size=4096)["auc"])


def tail(path: Path, marker: str) -> str | None:
    """The first line of `path` containing `marker` (stripped), or None."""
    if not path.exists():
        return None
    return next((ln.strip() for ln in path.read_text(errors="replace").splitlines() if marker in ln), None)


# ---- the faults --------------------------------------------------------------------------------------------
def f_none(data: dict, run: Path, args: argparse.Namespace) -> dict:
    result = run_job(data, run)
    return {"finished": result.finished, "restarts": result.restarts, "how": "undisturbed"}


def f_worker_sigkill(data: dict, run: Path, args: argparse.Namespace) -> dict:
    from recforge.pipelines.faults import SignalAt

    killer = SignalAt(run / "job" / "master_state.json", signal.SIGKILL, rank=1, min_done=7).start()
    result = run_job(data, run, recovery={"flash": True})
    killer.join()
    if killer.pid is None:
        raise RuntimeError(killer.error)
    return {"finished": result.finished, "restarts": result.restarts,
            "how": f"rank 1 SIGKILLed; {tail(run / 'job' / 'workers.log', 'resuming from') or 'no resume line'}"}


def f_worker_sigstop(data: dict, run: Path, args: argparse.Namespace) -> dict:
    from recforge.pipelines.faults import SignalAt

    stopper = SignalAt(run / "job" / "master_state.json", signal.SIGSTOP, rank=1, min_done=7).start()
    result = run_job(data, run, hang_timeout_s=args.hang_timeout_s)
    stopper.join()
    if stopper.pid is None:
        raise RuntimeError(stopper.error)
    failed = [a for a in result.attempts if a["outcome"] == "failed"]
    return {"finished": result.finished, "restarts": result.restarts,
            "how": f"rank 1 SIGSTOPped; {failed[0]['failure'][:120] if failed else 'no failed attempt'}"}


def f_master_sigkill(data: dict, run: Path, args: argparse.Namespace) -> dict:
    from recforge.elastic.backends.local import LocalBackend
    from recforge.elastic.policy import ResourcePlan
    from recforge.pipelines.faults import MasterProcess, wait_for, worker_pid
    from recforge.train.spec import WorkerSpec

    state_file = run / "master" / "state.json"
    master = MasterProcess(data["root"] / "train", data["batch"] * 4, state_file, run / "master")
    try:
        url = master.start()
        spec = spec_for(data, run)
        spec.update(master_url=url, threads_per_worker=1, master_token_file=str(master.token_file))
        spec_path = WorkerSpec.model_validate(spec).save(run / "spec.json")
        backend = LocalBackend(max_restarts=0, log_dir=run / "job")
        handle = backend.launch(spec_path, ResourcePlan(workers=2, threads_per_worker=1))
        try:
            wait_for("7 tasks done", lambda: worker_pid(state_file, rank=0, min_done=7) is not None, 600)
            master.kill()
            time.sleep(1.0)
            if master.start() != url:
                raise RuntimeError("the restarted master listens elsewhere")
            code = backend.wait(handle, timeout=600, check=False)
        finally:
            backend.stop(handle)
    finally:
        master.stop()
    resumed = "job master resumed from" in master.log_text(1)
    return {"finished": code == 0 and resumed, "restarts": 0,
            "how": f"master SIGKILLed, restarted on the same port ({'resumed its state' if resumed else 'NO resume'})"
                   f"; workers exit {code}"}


def f_mlflow_down(data: dict, run: Path, args: argparse.Namespace) -> dict:
    from recforge.pipelines.faults import MlflowServer, read_state, tasks_done, wait_for
    from recforge.tracking.store import TrackingStore

    server = MlflowServer(run / "mlflow")
    server.start()
    try:
        store = TrackingStore(server.uri, run / "mlflow" / "artifacts")
        run_id = store.stage_run("bench_faults", "mlflow_down", "train")
        state_file = run / "job" / "master_state.json"

        def outage() -> None:
            wait_for("2 tasks done", lambda: (s := read_state(state_file)) is not None and tasks_done(s) >= 2, 600)
            server.stop()
            time.sleep(args.mlflow_down_s)
            server.start()

        t = threading.Thread(target=outage, daemon=True)
        t.start()
        result = run_job(data, run, tracking_uri=server.uri, mlflow_run_id=run_id)
        store.log_metrics(run_id, {"rows": float(data["rows"])})  # the stage's own logging after the job
        t.join(timeout=args.mlflow_down_s + 300)
        store.finish(run_id)
        steps = [m.step for m in store.client.get_metric_history(run_id, "train_loss")]
        final_step = json.loads((run / "out" / "result.json").read_text()).get("steps")
        complete = len(steps) == len(set(steps)) and steps and max(steps) >= (final_step or 0) - LOG_EVERY
        return {"finished": bool(result.finished and complete and server.starts == 2), "restarts": result.restarts,
                "how": f"MLflow stopped {args.mlflow_down_s:.0f}s after 2 tasks; train_loss logged at {len(steps)} "
                       f"steps ({len(steps) - len(set(steps))} twice), last {max(steps) if steps else None} of "
                       f"{final_step}; run {store.client.get_run(run_id).info.status}"}
    finally:
        server.stop()


def _kill_then_corrupt(data: dict, run: Path, corrupt: str) -> dict:
    from recforge.elastic.backends.base import JobFailedError
    from recforge.pipelines.faults import corrupt_nan_region, corrupt_random, newest_checkpoint

    try:  # every generation dies at step 25 (after the step-10 and step-20 checkpoints)
        run_job(data, run, max_restarts=0, faults=[{"kind": "kill", "at_step": 25, "rank": 1}])
        raise RuntimeError("the job was meant to die at step 25")
    except JobFailedError:
        pass
    t0 = time.monotonic()
    newest = newest_checkpoint(run / "ckpt.steps")
    if corrupt == "random":
        victim = sorted(newest.glob("__1_*.distcp"))[0]
        corrupt_random(victim, nbytes=64)
        what = f"64 random bytes in {newest.name}/{victim.name}"
    else:
        region = corrupt_nan_region(newest)
        what = f"{region.length} NaN bytes over {region.key} in {newest.name}/{region.file.name}"
    result = run_job(data, run, max_restarts=0, resume=True)
    skipped = tail(run / "job" / "workers.log", "is unusable")
    return {"finished": result.finished and skipped is not None, "restarts": 1, "how": f"{what}; "
            f"{skipped.split('WARNING', 1)[-1].strip()[:200] if skipped else 'NOT detected'}",
            "extra_s": time.monotonic() - t0}


def f_checkpoint_random(data: dict, run: Path, args: argparse.Namespace) -> dict:
    return _kill_then_corrupt(data, run, "random")


def f_checkpoint_nan(data: dict, run: Path, args: argparse.Namespace) -> dict:
    return _kill_then_corrupt(data, run, "nan")


def f_checkpoint_dir_full(data: dict, run: Path, args: argparse.Namespace) -> dict:
    from recforge.elastic.backends.base import JobFailedError
    from recforge.pipelines.faults import grow_filesystem, small_filesystem

    one = args.checkpoint_bytes
    with small_filesystem(run / "ckptfs", int(one * 1.5)) as fs:
        try:
            run_job(data, run, max_restarts=1, checkpoint_dir=fs / "ckpt")
            message = "the job finished: the directory never filled (raise --checkpoint-bytes?)"
            failed_clearly = False
        except JobFailedError as e:
            message = str(e)
            failed_clearly = "no space left" in message.lower()
        grow_filesystem(fs, one * 8)  # the operator frees space; the job is resumed
        result = run_job(data, run, max_restarts=0, resume=True, checkpoint_dir=fs / "ckpt")
        got = auc(data, fs / "ckpt")
    first = next((ln for ln in message.splitlines() if "no space left" in ln.lower()), message[:300])
    first = first[first.lower().index("no space left"):] if "no space left" in first.lower() else first
    return {"finished": result.finished and failed_clearly, "restarts": 1, "auc": got,
            "how": f"tmpfs of {one * 1.5 / 2**20:.1f} MiB: failed clearly ({first.strip()[:230]}); resumed after "
                   f"growing it" if failed_clearly else message[:200]}


def run_airflow_faults(out_dir: Path) -> tuple[Path, str]:
    """The live-services run that injects both Airflow faults (its report lands in `out_dir`), and its output's
    tail when it failed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RECFORGE_TEST_ARTIFACTS": str(out_dir)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(REPO / "tests" / "e2e" / "test_train_retry_resumes.py")]
    print("airflow faults: live services + one DAG run (tests/e2e/test_train_retry_resumes.py) ...", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as e:
        return out_dir / "train_retry_resumes.json", f"timed out after {e.timeout:.0f} s"
    tail = "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-1500:]
    return out_dir / "train_retry_resumes.json", tail


def airflow_rows(report: Path, failure: str = "") -> list[dict]:
    base = {"rows_lost": None, "rows_twice_in_lineage": None, "auc_diff": None, "time_lost_s": None}
    if failure or not report.exists():
        why = f"the live run failed: {failure}" if failure else ("no report at " + str(report) + ": run without "
                                                                  "--no-airflow")
        return [{**base, "fault": f, "survived": "no" if failure else "not run", "how": why} for f in FAULTS[-2:]]
    r = json.loads(report.read_text())
    auc_diff = (r["auc_resumed"] - r["auc_undisturbed"]) if "auc_undisturbed" in r else None
    row = {**base, "survived": "yes" if [t["state"] for t in r["tries"]] == ["failed", "success"] else "no",
           "rows_lost": 0 if r.get("lineage_exactly_once", True) else None, "rows_twice_in_lineage": 0,
           "auc_diff": auc_diff, "time_lost_s": r.get("time_lost_s"), "source": str(report)}
    rows = [{**row, "fault": "airflow_task_sigkill", "how": f"e2e run {r['run_id']}: resumed from step "
             f"{r['checkpoints'].get('resumed_from_step')}"}]
    if "scheduler_restart_s" in r:
        rows.append({**row, "fault": "airflow_scheduler_restart", "time_lost_s": r["scheduler_restart_s"],
                     "auc_diff": None, "how": "scheduler stopped and started while the train task awaited its retry"})
    else:
        rows.append({**base, "fault": "airflow_scheduler_restart", "survived": "not run",
                     "how": "the e2e report has no scheduler restart"})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=6000)
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--mlflow-down-s", type=float, default=30.0)
    p.add_argument("--hang-timeout-s", type=float, default=20.0)
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(FAULTS)}")
    p.add_argument("--out", type=Path, default=RESULTS / "faults.json")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--no-airflow", action="store_true",
                   help="do not start live services for the Airflow faults; fold in tests/e2e/artifacts' report")
    args = p.parse_args()
    only = [f for f in args.only.split(",") if f] or list(FAULTS)
    unknown = sorted(set(only) - set(FAULTS))
    if unknown:
        p.error(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")

    root = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    data = prepare(root / "data", args.rows, args.batch)
    t0 = time.monotonic()
    f_none(data, root / "none", args)
    base_s = time.monotonic() - t0
    base_auc = auc(data, root / "none" / "ckpt")
    steps = sorted((root / "none" / "ckpt.steps").iterdir())
    args.checkpoint_bytes = max(sum(f.stat().st_size for f in s.iterdir()) for s in steps)
    rows = [{"fault": "none", "survived": "yes", **lineage(data, root / "none"), "time_lost_s": 0.0,
             "baseline_s": base_s, "auc": base_auc, "auc_diff": 0.0, "how": f"undisturbed, {base_s:.1f}s"}]
    print(f"undisturbed: {base_s:.1f}s, AUC {base_auc:.4f}", flush=True)
    for name in only:
        if name.startswith("airflow_"):
            continue
        run = root / name
        t1 = time.monotonic()
        try:
            out = globals()[f"f_{name}"](data, run, args)
            wall = time.monotonic() - t1
            got = out.get("auc")
            if got is None:
                got = auc(data, run / "ckpt")
            row = {"fault": name, "survived": "yes" if out["finished"] else "no", **lineage(data, run),
                   "time_lost_s": wall - base_s, "baseline_s": base_s, "auc": got, "auc_diff": got - base_auc,
                   "restarts": out["restarts"],
                   "how": out["how"]}
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # JobCancelled is a BaseException: a fault's run ends, the matrix goes on
            row = {"fault": name, "survived": "no", "rows_lost": None, "rows_twice_in_lineage": None,
                   "time_lost_s": time.monotonic() - t1 - base_s, "auc_diff": None,
                   "how": f"bench error: {type(e).__name__}: {str(e)[:300]}", "traceback": traceback.format_exc()}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}, default=str), flush=True)
    if any(f.startswith("airflow_") for f in only):
        if args.no_airflow:
            report, failure = REPO / "tests" / "e2e" / "artifacts" / "train_retry_resumes.json", ""
        else:
            report, failure = run_airflow_faults(root / "airflow")
        rows += [r for r in airflow_rows(report, failure) if r["fault"] in only]
    if args.only and args.out.exists():  # a subset re-measured: the other faults' rows stay as they were
        fresh = {r["fault"] for r in rows}
        kept = [r for r in json.loads(args.out.read_text()).get("faults", []) if r["fault"] not in fresh]
        for r in rows:
            r["measured"] = datetime.now(UTC).isoformat()
        rows = rows[:1] + kept + rows[1:]

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fault matrix: {args.rows} rows, 2 ranks x 1 thread, batch {args.batch}/rank, "
                        f"checkpoint every {CKPT_EVERY} steps")
    for col in ("fault", "survived", "rows lost", "rows twice", "time lost s", "AUC diff", "how"):
        table.add_column(col, overflow="fold")

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for r in rows:
        table.add_row(r["fault"], r["survived"], fmt(r.get("rows_lost"), "d"), fmt(r.get("rows_twice_in_lineage"), "d"),
                      fmt(r.get("time_lost_s"), ".1f"), fmt(r.get("auc_diff"), "+.4f"), r.get("how", ""))
    Console(width=200).print(table)
    write_report(args.out, {"benchmark": "faults", "when": datetime.now(UTC).isoformat(),
                            "machine": {"python": py_platform.python_version(), "cpus": os.cpu_count(),
                                        "load_avg_1m": os.getloadavg()[0]},
                            "rows": args.rows, "batch_per_rank": args.batch, "workers": 2,
                            "checkpoint_every_steps": CKPT_EVERY, "mlflow_down_s": args.mlflow_down_s,
                            "undisturbed_s": base_s, "undisturbed_auc": base_auc, "faults": rows})
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"run directories kept in {root}")


if __name__ == "__main__":
    main()
