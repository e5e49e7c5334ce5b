"""Shared fixtures. Test data lives in tests/data/ (see its README.md)."""
import importlib.util
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store with every migration applied, made once per session: a new store runs all of
    MLflow's migrations (~4 s of CPU each), a copy of this file opens at once. Only the schema: MLflow creates the
    Default experiment (with the test's own artifact root) when a store first opens the copy."""
    from mlflow.store.db.utils import _all_tables_exist, _initialize_tables, create_sqlalchemy_engine

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    engine = create_sqlalchemy_engine(f"sqlite:///{path}")
    try:
        _initialize_tables(engine)
        assert _all_tables_exist(engine), "MLflow's migrations left tables missing"
    finally:
        engine.dispose()
    assert not list(path.parent.glob("mlflow.db-*")), "the template store has an open journal"
    path.chmod(0o444)  # a copy is what tests write to, never this file
    return path


@pytest.fixture(scope="session")
def mlflow_db(mlflow_template) -> Callable[[Path], str]:
    """mlflow_db(path) -> 'sqlite:///path': a fresh, empty MLflow store at `path` (a copy of the migrated template)."""

    def make(path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            raise FileExistsError(f"mlflow_db: {path} exists; a fresh store needs a new path")
        shutil.copyfile(mlflow_template, path)
        return f"sqlite:///{path}"

    return make


def _use_home(mp: pytest.MonkeyPatch, home: Path, mlflow_db: Callable[[Path], str]) -> None:
    mp.setenv("RECFORGE_HOME", str(home))
    mp.setenv("MLFLOW_TRACKING_URI", mlflow_db(home / "mlflow" / "mlflow.db"))
    mp.setenv("RECFORGE_MLFLOW_ARTIFACTS", str(home / "mlflow" / "artifacts"))


@pytest.fixture
def recforge_home(tmp_path, monkeypatch, mlflow_db):
    """An isolated $RECFORGE_HOME with its own MLflow SQLite store."""
    home = tmp_path / "home"
    home.mkdir()
    _use_home(monkeypatch, home, mlflow_db)
    return home


@pytest.fixture(scope="module")
def module_home(tmp_path_factory, mlflow_db):
    """One $RECFORGE_HOME and MLflow SQLite store for a whole test module; tests in it keep their runs apart by
    run key."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as mp:
        _use_home(mp, home, mlflow_db)
        yield home


BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="session")
def load_bench() -> Callable[[str], ModuleType]:
    """load(name): a fresh import of bench/bench_<name>.py as module `bench_<name>_under_test` (bench/ on sys.path:
    the scripts import their siblings, _results and others)."""

    def load(name: str) -> ModuleType:
        if str(BENCH_DIR) not in sys.path:
            sys.path.insert(0, str(BENCH_DIR))
        spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", BENCH_DIR / f"bench_{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module

    return load
