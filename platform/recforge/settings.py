"""Environment of the embedded defaults: Airflow (LocalExecutor, SQLite) and MLflow (SQLite), under $RECFORGE_HOME.

`python -m recforge.settings` prints `export` lines; scripts/env.sh and the CLI use the same values.
"""
from __future__ import annotations

import os
import secrets
import shlex
import sqlite3
from pathlib import Path
from typing import Any


class ImmediateSQLiteConnection(sqlite3.Connection):
    """sqlite3 connection for Airflow's metadata DB whose write transactions take the write lock when they begin.

    A deferred transaction that read first and then writes while another process holds the write lock gets
    "database is locked" at once (SQLite skips the busy wait to avoid a deadlock): Airflow's `backfill create` does
    that (SAVEPOINT, SELECT, INSERT) while the scheduler writes. With `isolation_level="IMMEDIATE"` the driver's
    implicit BEGIN before DML is BEGIN IMMEDIATE, and a SAVEPOINT outside a transaction is preceded by one, so the
    lock is taken up front and waits out the busy timeout instead."""

    def cursor(self, factory: Any = None) -> sqlite3.Cursor:  # type: ignore[override]
        return super().cursor(factory or _ImmediateCursor)


class _ImmediateCursor(sqlite3.Cursor):
    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:  # type: ignore[override]
        if not self.connection.in_transaction and sql.lstrip()[:9].upper() == "SAVEPOINT":
            super().execute("BEGIN IMMEDIATE")
        return super().execute(sql, parameters)


# Airflow imports these by path ([database] sql_alchemy_connect_args / _async; set only for a sqlite:// conn): wait
# up to 60 s for another process's write lock (sqlite3's default is 5 s; the scheduler, API server, DAG processor,
# triggerer and CLI share one file), immediate write transactions (above).
AIRFLOW_SQLITE_CONNECT_ARGS: dict[str, Any] = {
    "timeout": 60.0, "isolation_level": "IMMEDIATE", "factory": ImmediateSQLiteConnection}
AIRFLOW_SQLITE_CONNECT_ARGS_ASYNC: dict[str, Any] = dict(AIRFLOW_SQLITE_CONNECT_ARGS)


def repo_root() -> Path:
    """The checkout this package is installed from (editable install): platform/recforge/settings.py -> ../../.."""
    return Path(__file__).resolve().parents[2]


def recforge_home() -> Path:
    """Where the embedded defaults keep their state: $RECFORGE_HOME, else <repo>/.recforge."""
    env = os.environ.get("RECFORGE_HOME")
    return Path(env).resolve() if env else repo_root() / ".recforge"


def jwt_secret(home: Path) -> str:
    """A per-install secret of 64 random bytes (hex), created once, readable by the owner only."""
    path = home / "secrets" / "jwt_secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(secrets.token_hex(64))
        tmp.chmod(0o600)
        os.replace(tmp, path)
    return path.read_text().strip()


def embedded_env(home: Path | None = None) -> dict[str, str]:
    home = home or recforge_home()
    root = repo_root()
    airflow_home = home / "airflow"
    return {
        "RECFORGE_HOME": str(home),
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(root / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(root / "plugins"),
        "AIRFLOW__CORE__EXECUTOR": "recforge.pipelines.task_executor.PreloadingLocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home / 'airflow.db'}",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": "8080",
        "AIRFLOW__API__BASE_URL": "http://127.0.0.1:8080",
        "AIRFLOW__API_AUTH__JWT_SECRET": jwt_secret(home),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE":
            str(airflow_home / "simple_auth_manager_passwords.json.generated"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
        "RECFORGE_MLFLOW_ARTIFACTS": str(home / "mlflow" / "artifacts"),
        "RECFORGE_MLFLOW_URL": "http://127.0.0.1:5000",
        # the landing zone recforge_daily reads by default (its source_uri Param; empty: synthetic days)
        "RECFORGE_SOURCE_URI": str(home / "landing" / "day_{ds}.tsv.gz"),
    }


def sqlite_connect_args_env() -> dict[str, str]:
    """Airflow's connect-args settings for a SQLite metadata DB, sync and async engines: immediate write
    transactions (ImmediateSQLiteConnection) and the busy timeout above."""
    return {
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "recforge.settings.AIRFLOW_SQLITE_CONNECT_ARGS",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC": "recforge.settings.AIRFLOW_SQLITE_CONNECT_ARGS_ASYNC",
    }


def apply_embedded_env(home: Path | None = None) -> dict[str, str]:
    """Fill in whatever the caller's environment does not already set (set but empty counts as set); a SQLite
    metadata DB also gets immediate write transactions and the busy timeout (another database's driver would refuse
    sqlite3's `timeout`)."""
    env = embedded_env(home)
    for key, value in env.items():
        os.environ.setdefault(key, value)
    if os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("sqlite"):
        for key, value in sqlite_connect_args_env().items():
            os.environ.setdefault(key, value)
            env[key] = value
    return {k: os.environ[k] for k in env}


if __name__ == "__main__":
    for k, v in {**embedded_env(), **sqlite_connect_args_env()}.items():
        print(f"export {k}={shlex.quote(v)}")
