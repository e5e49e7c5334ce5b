"""The recforge_daily DAG parses cleanly without heavy imports. A whole run is checked end to end against live
services in tests/e2e (test_browser triggers it from the UI; test_live_services checks what it recorded)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _env(home: Path) -> dict:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("AIRFLOW") or k.startswith("MLFLOW")]:
        del env[key]
    env["RECFORGE_HOME"] = str(home)
    out = subprocess.run([sys.executable, "-m", "recforge.settings"], env=env, capture_output=True, text=True,
                         check=True)
    for line in out.stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value.strip("'")
    return env


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory):
    """recforge's Airflow settings on a fresh home. Parsing needs no metadata database: none is migrated (an
    `airflow db migrate` costs a subprocess and tens of seconds on 2 cores)."""
    home = tmp_path_factory.mktemp("af")
    return home, _env(home)


def test_dagbag_imports_cleanly_and_without_heavy_modules(airflow_home):
    home, env = airflow_home
    code = (
        "import sys, json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(REPO / 'dags')!r})\n"
        "dag = bag.dags['recforge_daily']\n"
        "heavy = sorted(m for m in ('torch', 'torchrec', 'mlflow', 'pyarrow') if m in sys.modules)\n"
        "print(json.dumps({'errors': {k: str(v) for k, v in bag.import_errors.items()}, 'heavy': heavy,\n"
        "  'tasks': sorted(dag.task_ids),\n"
        "  'schedule': str(dag.schedule), 'catchup': dag.catchup, 'params': sorted(dag.params.keys()),\n"
        "  'workers': dag.params.get_param('workers').schema, 'retries': dag.default_args['retries'],\n"
        "  'on_failure': getattr(dag.on_failure_callback, '__name__', None),\n"
        "  'roots': [t.task_id for t in dag.roots], 'first': sorted(dag.get_task('wait_for_data').downstream_task_ids),"
        "\n  'sensor': type(dag.get_task('wait_for_data')).__mro__[1].__name__,\n"
        "  'deferrable': dag.get_task('wait_for_data').deferrable,\n"
        "  'source_uri': dag.params.get_param('source_uri').value}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["errors"] == {}
    assert info["heavy"] == [], "parsing the DAG must not import heavy libraries"
    assert set(info["tasks"]) == {"wait_for_data", "generate", "ingest", "plan_resources", "train", "evaluate",
                                  "compile", "publish"}
    # the deferrable landing sensor comes first; make up's landing zone is the source_uri default
    assert info["roots"] == ["wait_for_data"] and info["first"] == ["generate"]
    assert info["sensor"] == "BaseSensorOperator" and info["deferrable"] is True
    assert info["source_uri"] == str(home / "landing" / "day_{ds}.tsv.gz")
    assert "CronDataIntervalTimetable" in info["schedule"] and info["catchup"] is False
    assert {"dataset_schema", "rows_per_day", "workers", "epochs", "batch_size", "seed", "resources_policy",
            "preprocessing", "corun_mapping", "preprocess_executor", "preprocess_plan", "max_restarts",
            "checkpoint_every_steps", "checkpoint_flash", "warm_start", "champion_min_auc"} <= set(info["params"])
    assert info["workers"] == {"type": "integer", "minimum": 1}  # bounds from the config field
    assert info["retries"] == 1 and info["on_failure"] == "close_open_runs"
