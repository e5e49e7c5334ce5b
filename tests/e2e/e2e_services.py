"""Live recforge services for the end-to-end tests: scripts/services.sh in an isolated RECFORGE_HOME on free
ports, and small clients for Airflow's REST API (/api/v2, JWT) and MLflow's (/api/2.0/mlflow)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "scripts" / "services.sh"
DAG_ID = "recforge_daily"
# tiny Params: a whole run in a few minutes on 2 cores
# compile_backend export: these runs test the platform, not RECom's C++ build (the browser run keeps the default)
TINY = {"rows_per_day": 3000, "batch_size": 256, "table_cap": 5000, "workers": 2, "compile_backend": "export"}


def running(pid: int) -> bool:
    """Whether the process runs: a zombie (exited, not yet reaped by this container's init) does not."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def artifacts_dir() -> Path:
    path = Path(os.environ.get("RECFORGE_TEST_ARTIFACTS") or REPO / "tests" / "e2e" / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_env(home: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without any recforge / Airflow / MLflow settings: scripts/env.sh derives them all
    from RECFORGE_HOME and the ports (so the test never touches the checkout's .recforge)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "MLFLOW", "RECFORGE_")) or k == "RECFORGE_VENV"}
    env.update(RECFORGE_HOME=str(home), RECFORGE_AIRFLOW_PORT=str(free_port()),
               RECFORGE_MLFLOW_PORT=str(free_port()), RECFORGE_LOG_SERVER_PORT=str(free_port()),
               RECFORGE_UP_TIMEOUT="360",
               # the scheduler would otherwise start the day's scheduled run (default Params) on its own
               AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="True")
    env.update(extra)
    return env


def services(command: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(SERVICES), command], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


class RunFailed(AssertionError):
    pass


@dataclass
class LiveServices:
    home: Path
    env: dict[str, str]
    airflow_url: str
    mlflow_url: str
    password: str
    token: str = ""
    owned: set[str] = field(default_factory=set)  # run ids the tests triggered
    succeeded: dict[str, dict] = field(default_factory=dict)  # run id -> the DAG run (conf included), as it ended
    foreign_checked_at: float = float("-inf")  # time.monotonic() of the last fail_foreign_runs

    # Airflow ---------------------------------------------------------------------------------------
    def login(self) -> str:
        r = httpx.post(f"{self.airflow_url}/auth/token", json={"username": "admin", "password": self.password},
                       timeout=30)
        r.raise_for_status()
        self.token = r.json()["access_token"]
        return self.token

    def api(self, method: str, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}", **kw.pop("headers", {})}
        return httpx.request(method, f"{self.airflow_url}{path}", headers=headers, timeout=60, **kw)

    def wait_for_dag(self, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            r = self.api("GET", f"/api/v2/dags/{DAG_ID}")
            if r.status_code == 200:
                return r.json()
            if time.monotonic() > deadline:
                raise AssertionError(f"{DAG_ID} not parsed after {timeout}s: {r.status_code} {r.text[:500]}")
            time.sleep(2)

    def unpause(self) -> None:
        r = self.api("PATCH", f"/api/v2/dags/{DAG_ID}", json={"is_paused": False})
        assert r.status_code == 200 and r.json()["is_paused"] is False, r.text

    def runs(self) -> list[dict]:
        r = self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns", params={"limit": 100})
        r.raise_for_status()
        return r.json()["dag_runs"]

    def fail_foreign_runs(self) -> list[str]:
        """Unpausing lets the scheduler start the latest scheduled run with the default (large) Params;
        with max_active_runs=1 it would hold up the tests' runs. Mark every run the tests did not start failed."""
        failed = []
        for run in self.runs():
            if run["dag_run_id"] not in self.owned and run["state"] in ("queued", "running"):
                r = self.api("PATCH", f"/api/v2/dags/{DAG_ID}/dagRuns/{run['dag_run_id']}", json={"state": "failed"})
                assert r.status_code == 200, r.text
                failed.append(run["dag_run_id"])
        return failed

    def keep_foreign_runs_off(self, every_s: float = 10.0) -> None:
        """fail_foreign_runs, at most every `every_s` seconds: a poll loop calls this on each turn. Listing the runs
        costs the API server ~70 ms of CPU (a run's GET ~35 ms, load ~3 on 2 cores): on every turn of a 1 s poll
        that is a tenth of a core taken from the pipeline the test waits for; a foreign run only appears at the
        session's start (the unpause) and at midnight UTC."""
        if time.monotonic() - self.foreign_checked_at >= every_s:
            self.foreign_checked_at = time.monotonic()
            self.fail_foreign_runs()

    def trigger(self, run_id: str, conf: dict, attempts: int = 5) -> httpx.Response:
        """POST a DAG run. A 500 "Database error" (SQLite locked while the scheduler writes, e.g. right after the
        unpause) rolled the insert back: tried again, `attempts` times in all, 2 s apart."""
        self.owned.add(run_id)
        for _ in range(attempts):
            r = self.api("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                         json={"dag_run_id": run_id, "logical_date": None, "conf": conf})
            if r.status_code != 500 or "Database error" not in r.text:
                return r
            time.sleep(2)
        return r

    def wait_for_run(self, run_id: str, timeout: float = 600) -> dict:
        self.owned.add(run_id)
        deadline = time.monotonic() + timeout
        while True:
            self.keep_foreign_runs_off()
            r = self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")
            if r.status_code == 401:  # token expired: log in again
                self.login()
                continue
            r.raise_for_status()
            run = r.json()
            if run["state"] == "success":
                self.succeeded[run_id] = run
                return run
            if run["state"] == "failed" or time.monotonic() > deadline:
                raise RunFailed(f"run {run_id} is {run['state']} after {timeout - (deadline - time.monotonic()):.0f}s"
                                f"\n{self.describe(run_id)}")
            time.sleep(2)  # its end seen within 2 s (it was 5 s), for ~2% of a core (see keep_foreign_runs_off)

    def describe(self, run_id: str) -> str:
        """Task states and the log tail of failed tasks, for failure messages."""
        lines = []
        tis = self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances").json()
        for ti in tis.get("task_instances", []):
            lines.append(f"  {ti['task_id']}: {ti['state']} (try {ti['try_number']})")
            if ti["state"] == "failed":
                log = self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{ti['task_id']}"
                                      f"/logs/{ti['try_number']}", headers={"Accept": "text/plain"}).text
                lines.append("    " + "\n    ".join(log.splitlines()[-30:]))
        return "\n".join(lines)

    # MLflow ----------------------------------------------------------------------------------------
    def mlflow(self, method: str, path: str, **kw) -> dict:
        r = httpx.request(method, f"{self.mlflow_url}/api/2.0/mlflow/{path}", timeout=60, **kw)
        assert r.status_code == 200, f"MLflow {method} {path}: {r.status_code} {r.text[:500]}"
        return r.json()

    # teardown --------------------------------------------------------------------------------------
    def keep_logs(self, name: str) -> Path:
        target = artifacts_dir() / name / "logs"
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(self.home / "logs", target, ignore=shutil.ignore_patterns("db-migrate.log"))
        return target


def start(home: Path, **extra: str) -> LiveServices:
    env = service_env(home, **extra)
    up = services("up", env)
    if up.returncode != 0:
        services("down", env)
        raise AssertionError(f"scripts/services.sh up failed ({up.returncode}):\n"
                             f"{up.stdout[-4000:]}\n{up.stderr[-4000:]}")
    passwords = Path(home / "airflow" / "simple_auth_manager_passwords.json.generated")
    live = LiveServices(home=home, env=env, airflow_url=f"http://127.0.0.1:{env['RECFORGE_AIRFLOW_PORT']}",
                        mlflow_url=f"http://127.0.0.1:{env['RECFORGE_MLFLOW_PORT']}",
                        password=json.loads(passwords.read_text())["admin"])
    live.login()
    return live
