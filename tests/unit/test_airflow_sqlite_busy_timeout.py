"""Every Airflow process started through scripts/env.sh (scheduler, API server, CLI) waits for another's write lock
on the SQLite metadata DB instead of failing with "database is locked" after sqlite3's default 5 s; a non-SQLite
conn gets no sqlite-only connect args."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from recforge.settings import AIRFLOW_SQLITE_CONNECT_ARGS, embedded_env, sqlite_connect_args_env

REPO = Path(__file__).resolve().parents[2]

# In the child: Airflow's own engines (sync and async) and the busy timeout each connection got; then, once the
# parent holds the write lock (for ~6 s, longer than sqlite3's default 5 s), what `airflow backfill create` does per
# day: SAVEPOINT, SELECT, INSERT. A deferred transaction would get "database is locked" at the INSERT at once.
PROBE = r"""
import asyncio, sys, time
from airflow import settings
from sqlalchemy import text
from sqlalchemy.orm import Session
with settings.engine.connect() as conn:
    print("sync", conn.exec_driver_sql("PRAGMA busy_timeout").scalar(), flush=True)
    conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS busy_probe (x INTEGER)")
    conn.commit()
async def probe():
    async with settings.async_engine.connect() as conn:
        print("async", (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar(), flush=True)
asyncio.run(probe())
sys.stdin.readline()  # the parent now holds the write lock
t0 = time.monotonic()
with Session(settings.engine) as session:
    with session.begin_nested():
        n = session.execute(text("SELECT count(*) FROM busy_probe")).scalar()
        session.execute(text("INSERT INTO busy_probe VALUES (:x)"), {"x": n})
    session.commit()
print("wrote after", round(time.monotonic() - t0, 1), flush=True)
"""


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "RECFORGE_"))}
    return {**env, "RECFORGE_HOME": str(home), **extra}


def _env_sh(env: dict[str, str], names: list[str]) -> dict[str, str]:
    script = ". scripts/env.sh && " + " && ".join(f'echo "{n}=${{{n}:-}}"' for n in names)
    out = subprocess.run(["bash", "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def test_env_sh_sets_the_busy_timeout_for_sqlite_only(tmp_path):
    names = list(sqlite_connect_args_env())
    sqlite = _env_sh(_clean_env(tmp_path), names)
    assert sqlite == sqlite_connect_args_env()
    postgres = _env_sh(_clean_env(tmp_path, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="postgresql+psycopg2://h/airflow"),
                       names)
    assert postgres == {n: "" for n in names}


def test_airflow_read_then_write_waits_for_a_held_sqlite_write_lock(tmp_path):
    home = tmp_path / "home"
    db = home / "airflow" / "airflow.db"
    db.parent.mkdir(parents=True)
    env = {**_clean_env(home), **embedded_env(home), **sqlite_connect_args_env()}
    child = subprocess.Popen([sys.executable, "-c", PROBE], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        expected_ms = int(float(AIRFLOW_SQLITE_CONNECT_ARGS["timeout"]) * 1000)  # type: ignore[arg-type]
        assert child.stdout.readline().split() == ["sync", str(expected_ms)]
        assert child.stdout.readline().split() == ["async", str(expected_ms)]
        holder = sqlite3.connect(db, timeout=10, isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")  # the write lock; others may still read (as while the scheduler writes)
        holder.execute("INSERT INTO busy_probe VALUES (-1)")
        release = threading.Timer(6.0, lambda: holder.execute("COMMIT"))
        t0 = time.monotonic()
        child.stdin.write("go\n")
        child.stdin.flush()
        release.start()
        line = child.stdout.readline()
        waited = time.monotonic() - t0
        release.join()
        holder.close()
        assert line.startswith("wrote after"), line + child.stderr.read()[-3000:]
        assert waited >= 5.5, f"the write did not wait for the lock ({waited:.1f} s)"
        assert child.wait(timeout=60) == 0
        rows = sqlite3.connect(db).execute("SELECT x FROM busy_probe ORDER BY x").fetchall()
        assert rows == [(-1,), (1,)], rows  # the child's read saw the parent's committed row
    finally:
        child.kill()
