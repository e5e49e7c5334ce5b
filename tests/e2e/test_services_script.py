"""scripts/services.sh (make up / make down) beyond the happy path the other e2e tests share: a service that
fails to start makes `up` fail with that service's log tail, `down` then stops everything it started; and
with connection URLs configured the services run on PostgreSQL instead of SQLite."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from e2e_services import free_port, service_env, services

pytestmark = pytest.mark.slow


def _pids(home: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in (home / "run").glob("*.pid")}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return False
    except ProcessLookupError:
        return True


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
    assert _pids(home) == {} and all(_gone(p) for p in started.values())


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
