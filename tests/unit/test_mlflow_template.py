"""tests/conftest.py's MLflow store template: a copy is the same store a fresh one is (same tables, columns and
migration revision), with no experiment in it: the store that opens a copy creates the Default experiment as it does in
a fresh one."""
import sqlite3
from pathlib import Path

import pytest


def _schema(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        tables = sorted(r[0] for r in conn.execute("select name from sqlite_master where type = 'table'"))
        return [(t, sorted(tuple(c) for c in conn.execute(f"pragma table_info('{t}')")),
                 sorted(tuple(i)[1:] for i in conn.execute(f"pragma index_list('{t}')")))
                for t in tables] + [tuple(conn.execute("select version_num from alembic_version").fetchall())]


def test_a_copied_store_is_a_fresh_store(tmp_path, mlflow_template, mlflow_db):
    from recforge.tracking import TrackingStore

    fresh = TrackingStore(f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}", tmp_path / "fresh" / "artifacts")
    fresh.client.search_experiments()  # opening it migrates it
    with sqlite3.connect(mlflow_template) as conn:
        assert conn.execute("select count(*) from experiments").fetchone() == (0,)  # nothing shared between copies
    copied = TrackingStore(mlflow_db(tmp_path / "copy" / "mlflow.db"), tmp_path / "copy" / "artifacts")
    default, fresh_default = copied.client.get_experiment("0"), fresh.client.get_experiment("0")
    assert _schema(tmp_path / "copy" / "mlflow.db") == _schema(tmp_path / "fresh" / "mlflow.db")
    assert (default.name, default.artifact_location) == (fresh_default.name, fresh_default.artifact_location)
    run_id = copied.stage_run("template_check", "k", "train")
    assert copied.client.get_run(run_id).info.experiment_id != "0"
    with pytest.raises(FileExistsError):
        mlflow_db(tmp_path / "copy" / "mlflow.db")
