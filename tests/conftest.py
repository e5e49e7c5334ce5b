"""Shared fixtures. Test data lives in tests/data/ (see its README.md)."""
import pytest


@pytest.fixture
def recforge_home(tmp_path, monkeypatch):
    """An isolated $RECFORGE_HOME with its own MLflow SQLite store."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("RECFORGE_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow' / 'mlflow.db'}")
    monkeypatch.setenv("RECFORGE_MLFLOW_ARTIFACTS", str(home / "mlflow" / "artifacts"))
    return home
