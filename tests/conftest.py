"""Shared fixtures. Test data lives in tests/data/ (see its README.md)."""
from pathlib import Path

import pytest


def _use_home(mp: pytest.MonkeyPatch, home: Path) -> None:
    mp.setenv("RECFORGE_HOME", str(home))
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow' / 'mlflow.db'}")
    mp.setenv("RECFORGE_MLFLOW_ARTIFACTS", str(home / "mlflow" / "artifacts"))


@pytest.fixture
def recforge_home(tmp_path, monkeypatch):
    """An isolated $RECFORGE_HOME with its own MLflow SQLite store."""
    home = tmp_path / "home"
    home.mkdir()
    _use_home(monkeypatch, home)
    return home


@pytest.fixture(scope="module")
def module_home(tmp_path_factory):
    """One $RECFORGE_HOME and MLflow SQLite store for a whole test module (a new store costs seconds); tests in it
    keep their runs apart by run key."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        _use_home(mp, home)
        yield home
