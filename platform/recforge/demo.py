"""`make demo`: run the recforge_daily DAG once through Airflow (`airflow dags test`) on the embedded defaults.

No data needed: the demo seeds the landing zone ($RECFORGE_HOME/landing) with synthetic days for the run's window
(landing.land_synthetic), so the run goes the production path: wait_for_data sees them land, generate reads them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from recforge.config import PipelineConfig
from recforge.pipelines import landing
from recforge.pipelines.context import EXPERIMENT, RunContext
from recforge.pipelines.dag_tasks import config_from_params, stage_timeout
from recforge.pipelines.runner import STAGES
from recforge.pipelines.summary import summarize
from recforge.settings import apply_embedded_env

DAG_ID = "recforge_daily"
MIGRATE_TIMEOUT_S = 600.0  # `airflow db migrate` of the embedded SQLite database
DEMO_POKE_S = 2.0  # the demo's just-written days count as landed after this long (sensor_poke_s)


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


def _airflow(*args: str, log: Path, env: dict) -> subprocess.Popen:
    binary = Path(sys.executable).with_name("airflow")
    handle = open(log, "ab")
    return subprocess.Popen([str(binary), *args], stdout=handle, stderr=subprocess.STDOUT, env=env)


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _newest_run_dir(runs: Path, since: float) -> Path | None:
    if not runs.exists():
        return None
    candidates = [d for d in runs.iterdir() if d.is_dir() and d.stat().st_mtime >= since - 1]
    return max(candidates, key=lambda d: d.stat().st_ctime) if candidates else None


def run_demo(rows_per_day: int, workers: int, epochs: int, console: Console) -> dict:
    env_vars = apply_embedded_env()
    home = Path(env_vars["RECFORGE_HOME"])
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "demo.log"
    env = dict(os.environ)

    with console.status("preparing the Airflow metadata database (airflow db migrate)"):
        migrate = _airflow("db", "migrate", log=log, env=env)
        try:
            code = migrate.wait(timeout=MIGRATE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(migrate)
            raise RuntimeError(f"airflow db migrate did not finish within {MIGRATE_TIMEOUT_S:.0f}s and was stopped; "
                               f"see {log}:\n{_tail(log)}") from None
        if code != 0:
            raise RuntimeError(f"airflow db migrate failed; see {log}:\n{_tail(log)}")

    when = datetime.now(UTC).replace(microsecond=0)  # the run's logical date: its day is today's
    zone = home / "landing"
    conf = {"rows_per_day": rows_per_day, "workers": workers, "epochs": epochs,
            "source_uri": str(zone / "day_{ds}.tsv.gz"), "sensor_poke_s": DEMO_POKE_S}
    days = landing.window(PipelineConfig.model_validate(config_from_params(conf)), when.date())
    with console.status(f"landing synthetic days {days[0][0]} .. {days[-1][0]} in {zone}"):
        landing.land_synthetic(zone, days[0][0], len(days), rows_per_day=rows_per_day)
    start = time.time()
    proc = _airflow("dags", "test", DAG_ID, when.isoformat(), "-c", json.dumps(conf), log=log, env=env)
    limit_s = sum(stage_timeout(s).total_seconds() for s in STAGES)  # each task is bounded by its own too
    runs = home / "runs" / EXPERIMENT
    run_dir = None
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} stages"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task(f"{DAG_ID} (log: {log})", total=len(STAGES))
        while proc.poll() is None:
            run_dir = run_dir or _newest_run_dir(runs, start)
            if run_dir is not None:
                done = [s for s in STAGES if (run_dir / s / "outputs.json").exists()]
                pending = next((s for s in STAGES if s not in done), "finishing")
                bar.update(task, completed=len(done), description=f"{DAG_ID}: {pending}")
            if time.time() - start > limit_s:
                _stop(proc)
                raise RuntimeError(f"the {DAG_ID} run did not finish within {limit_s:.0f}s (its tasks' "
                                   f"execution_timeout together) and was stopped; see {log}:\n{_tail(log)}")
            time.sleep(1.0)
        run_dir = run_dir or _newest_run_dir(runs, start)
        if run_dir is not None:
            bar.update(task, completed=sum((run_dir / s / "outputs.json").exists() for s in STAGES))
    if run_dir is None:
        raise RuntimeError(f"the {DAG_ID} run wrote no outputs (exit {proc.returncode}); see {log}:\n{_tail(log)}")
    ctx = RunContext.create(run_dir.name, PipelineConfig(**{"rows_per_day": rows_per_day}), home=home)
    from recforge.ui.mlflow_view import MlflowView  # lazy: mlflow (seconds to import) once the run is done

    summary = summarize(ctx, MlflowView(ctx.tracking_uri, ctx.experiment))
    if proc.returncode != 0 or not (run_dir / "publish" / "outputs.json").exists():
        raise RuntimeError(f"the {DAG_ID} run did not finish (exit {proc.returncode}): {summary['status']['text']}; "
                           f"`recforge summary {ctx.run_key}` shows how far it got; see {log}:\n{_tail(log)}")
    return summary


def how_to_open() -> str:
    env = apply_embedded_env()
    pw = Path(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
    return (
        "Open the UIs: `make up`, then Airflow at http://127.0.0.1:8080 "
        f"(user admin; the password is generated on first start into {pw}) and MLflow at http://127.0.0.1:5000; "
        "`make down` stops them."
    )
