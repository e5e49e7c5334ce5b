"""scripts/services.sh (make up / make down) beyond the happy path the other e2e tests share: a service that
fails to start makes `up` fail with that service's log tail, `down` then stops everything it started; with
connection URLs configured the services run on PostgreSQL instead of SQLite; and `down` during a training job
returns only when nothing of the platform runs (a stand-in platform of real processes, no Airflow)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from e2e_services import free_port, running, service_env, services

pytestmark = pytest.mark.slow


def _pids(home: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in (home / "run").glob("*.pid")}


def test_up_fails_with_the_log_tail_of_a_service_that_does_not_start(tmp_path):
    home = tmp_path / "home"
    env = service_env(home, RECFORGE_MLFLOW_BACKEND="bogus://nowhere", RECFORGE_UP_TIMEOUT="120")
    try:
        up = services("up", env, timeout=300)
        out = up.stdout + up.stderr
        assert up.returncode != 0, out
        assert "mlflow exited during startup" in up.stderr, out
        assert f"last lines of {home}/logs/mlflow.log" in out and "bogus://nowhere" in out, out
        started = _pids(home)
        assert {"api-server", "scheduler", "dag-processor"} <= set(started), started
    finally:
        down = services("down", env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert _pids(home) == {} and not any(running(p) for p in started.values())


PG_BIN = Path("/usr/lib/postgresql/15/bin")


@pytest.fixture
def postgres(tmp_path):
    """A throwaway PostgreSQL cluster on a free loopback port, as the `postgres` user (initdb refuses root)."""
    if not (PG_BIN / "initdb").exists() or shutil.which("runuser") is None or os.geteuid() != 0:
        pytest.skip("needs Debian's PostgreSQL server (postgresql) and root to run it as the postgres user")
    # pytest's tmp_path lies under a root-only directory: the cluster gets its own, owned by postgres
    data, port = Path(tempfile.mkdtemp(prefix="recforge-pg-")), free_port()
    shutil.chown(data, "postgres", "postgres")

    def as_postgres(*cmd: str) -> None:
        out = subprocess.run(["runuser", "-u", "postgres", "--", *cmd], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{cmd}: {out.stdout[-2000:]} {out.stderr[-2000:]}"

    try:
        as_postgres(str(PG_BIN / "initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "postgres")
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data / "db"), "-l", str(data / "server.log"), "-w", "-o",
                    f"-c listen_addresses=127.0.0.1 -p {port} -k {data}", "start")
        for db in ("airflow", "mlflow"):
            as_postgres(str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", db)
        yield f"postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / "pg_ctl"), "-D", str(data / "db"),
                        "-m", "fast", "stop"], capture_output=True, timeout=120)
        shutil.rmtree(data, ignore_errors=True)


def _tables(address: str, db: str) -> set[str]:
    user, hostport = address.split("@")
    host, port = hostport.split(":")
    out = subprocess.run(["psql", "-h", host, "-p", port, "-U", user, "-d", db, "-Atc",
                          "select tablename from pg_tables where schemaname = 'public'"],
                         check=True, capture_output=True, text=True, timeout=60)
    return set(out.stdout.split())


def test_services_run_on_postgresql_when_urls_are_configured(tmp_path, postgres):
    home = tmp_path / "home"
    env = service_env(home, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"postgresql+psycopg2://{postgres}/airflow",
                      RECFORGE_MLFLOW_BACKEND=f"postgresql+psycopg2://{postgres}/mlflow")
    try:
        up = services("up", env)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        health = httpx.get(f"http://127.0.0.1:{env['RECFORGE_AIRFLOW_PORT']}/api/v2/monitor/health", timeout=30).json()
        assert health["metadatabase"]["status"] == "healthy"
        assert httpx.get(f"http://127.0.0.1:{env['RECFORGE_MLFLOW_PORT']}/health", timeout=30).status_code == 200
    finally:
        down = services("down", env)
    assert down.returncode == 0
    assert {"dag", "dag_run", "task_instance"} <= _tables(postgres, "airflow")
    assert {"experiments", "runs", "registered_models"} <= _tables(postgres, "mlflow")
    assert not (home / "airflow" / "airflow.db").exists() and not (home / "mlflow" / "mlflow.db").exists()


# A stand-in for the platform under `down`, with real processes: a "scheduler" whose task process (a process group
# of its own, as Airflow starts it) runs a training job (real torchrun, stub ranks that never finish) and which exits
# on SIGTERM without passing it on; an "api-server" that ignores SIGTERM; an "mlflow"; an orphan of a killed task.
HERE = Path(__file__).resolve().parent
UNIT = HERE.parent / "unit"
SCHEDULER = """
import signal, subprocess, sys, time
task = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], process_group=0,
                        stdout=open(sys.argv[2] + "/task.log", "w"), stderr=subprocess.STDOUT)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(3600)
"""
TASK = """
import json, sys
from pathlib import Path
from recforge.config import ResourceConfig
from recforge.elastic.job import run_training_job
from recforge.elastic.policy import StaticPolicy
from test_elastic_local import SHARDS, stub_backend, stub_spec

tmp = Path(sys.argv[1])
res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=2)  # a relaunch would be allowed
attempts = tmp / "attempts.jsonl"
run_training_job(stub_spec(tmp / "out", hang=True), SHARDS, resources=res, state_dir=tmp / "job",
                 policy=StaticPolicy(res, cpu_count=2), backend=stub_backend(max_restarts=0), timeout_s=300,
                 on_attempt=lambda a: attempts.open("a").write(json.dumps(a.__dict__) + "\\n"))
"""
IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
ORPHAN = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])"


def _alive(pids: list[int]) -> list[int]:
    """The pids still running (a zombie has exited)."""
    return [pid for pid in pids if running(pid)]


def test_down_during_a_training_job_leaves_nothing_of_the_platform_running(tmp_path):
    home = tmp_path / "home"
    (home / "run").mkdir(parents=True)
    env = {**service_env(home, RECFORGE_DOWN_GRACE="3"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(UNIT), os.environ.get("PYTHONPATH")) if p)}
    marked = {**env, "RECFORGE_SERVICES_HOME": str(home)}  # what services.sh start gives every service

    def service(name: str, code: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], env=marked, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (home / "run" / f"{name}.pid").write_text(f"{proc.pid}\n")
        return proc

    started = [service("scheduler", SCHEDULER, TASK, str(tmp_path)), service("api-server", IGNORES_SIGTERM),
               service("mlflow", "import time; time.sleep(3600)")]
    orphan_parent = subprocess.run([sys.executable, "-c", ORPHAN], env=marked, start_new_session=True, timeout=60)
    assert orphan_parent.returncode == 0
    platform: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "out").glob("running-*"))) < 2:  # the job's two ranks run
            assert time.monotonic() < deadline, (tmp_path / "task.log").read_text()[-3000:]
            time.sleep(0.2)
        platform = [p.pid for p in psutil.process_iter(["environ"])
                    if (p.info["environ"] or {}).get("RECFORGE_SERVICES_HOME") == str(home)]
        cmdlines = [" ".join(psutil.Process(p).cmdline()) for p in platform]
        assert sum("torch.distributed.run" in c for c in cmdlines) == 1 and len(platform) >= 8, cmdlines

        down = services("down", env, timeout=300)
        out = down.stdout + down.stderr
        assert down.returncode == 0, out
        assert _alive(platform) == [], out
        assert f"KILL {started[1].pid}:" in out, out  # what had to be killed is named
        assert "nothing of the platform runs" in out and not list((home / "run").glob("*.pid")), out
        # the job was shut down, not failed: one launch, stopped, nothing relaunched
        attempts = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
        assert [(a["outcome"], a["relaunched"]) for a in attempts] == [("stopped", False)], attempts
        assert (tmp_path / "job" / "workers.log").read_text().count(" launch: ") == 1
    finally:
        for pid in _alive(platform + [p.pid for p in started]):  # a failed test leaves nothing behind either
            os.kill(pid, signal.SIGKILL)
