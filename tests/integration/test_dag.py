"""The recforge_daily DAG: it parses cleanly, and one `dag.test()` run on tiny data goes end to end."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recforge.pipelines.outputs import STAGE_OUTPUTS, PublishOutputs

REPO = Path(__file__).resolve().parents[2]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))


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
    home = tmp_path_factory.mktemp("af")
    env = _env(home)
    subprocess.run([AIRFLOW, "db", "migrate"], env=env, check=True, capture_output=True)
    return home, env


def test_dagbag_imports_cleanly_and_without_heavy_modules(airflow_home):
    _, env = airflow_home
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
        "  'on_failure': getattr(dag.on_failure_callback, '__name__', None)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["errors"] == {}
    assert info["heavy"] == [], "parsing the DAG must not import heavy libraries"
    assert set(info["tasks"]) == {"generate", "ingest", "plan_resources", "train", "evaluate", "compile", "publish"}
    assert info["schedule"] == "@daily" and info["catchup"] is False
    assert {"dataset_preset", "rows_per_day", "workers", "epochs", "batch_size", "seed", "resources_policy",
            "preprocessing", "corun_mapping", "preprocess_executor", "preprocess_plan", "max_restarts",
            "checkpoint_every_steps", "checkpoint_flash", "warm_start", "champion_min_auc"} <= set(info["params"])
    assert info["workers"] == {"type": "integer", "minimum": 1}  # bounds from the config field
    assert info["retries"] == 1 and info["on_failure"] == "close_open_runs"


@pytest.mark.slow
def test_dag_test_runs_end_to_end_and_registers_a_model(airflow_home):
    home, env = airflow_home
    conf = {"rows_per_day": 4000, "workers": 2, "epochs": 1, "batch_size": 64, "seed": 7, "table_cap": 5000}
    proc = subprocess.run([AIRFLOW, "dags", "test", "recforge_daily", "-c", json.dumps(conf)],
                          env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    runs = list((home / "runs" / "recforge_daily").iterdir())
    assert proc.returncode == 0, log[-4000:]
    assert len(runs) == 1, log[-4000:]
    run_dir = runs[0]
    for stage, model in STAGE_OUTPUTS.items():  # every stage recorded outputs that read back as its model
        assert (run_dir / stage / "outputs.json").exists(), f"{stage} has no outputs\n{log[-4000:]}"
        model.model_validate_json((run_dir / stage / "outputs.json").read_text())
    published = PublishOutputs.model_validate_json((run_dir / "publish" / "outputs.json").read_text())

    code = (
        "import json\n"
        "from recforge.tracking import TrackingStore, ModelRegistry\n"
        "s = TrackingStore(); r = ModelRegistry(s)\n"
        f"v = s.client.get_model_version('recforge-dlrm', {published.version!r})\n"
        "champ = r.champion()\n"
        f"runs = s.stage_runs('recforge_daily', {run_dir.name!r})\n"
        "parent = runs['pipeline']\n"
        "print(json.dumps({'version': v.version, 'status': v.status, 'champion': champ.version if champ else None,\n"
        "  'stages': sorted(runs), 'rows_per_day': parent.data.params.get('rows_per_day'),\n"
        "  'auc': runs['evaluate'].data.metrics.get('auc'),\n"
        "  'train_metrics': sorted(runs['train'].data.metrics)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["status"] == "READY"
    assert info["champion"] == info["version"]  # first model becomes champion
    assert info["stages"] == sorted(["pipeline", *STAGE_OUTPUTS])
    assert info["rows_per_day"] == "4000"  # the Param reached the pipeline
    assert 0.0 < info["auc"] <= 1.0
    # the workers logged windowed training quality every log_every steps
    assert {"train_auc", "train_logloss", "train_ne", "train_loss", "samples_per_s"} <= set(info["train_metrics"])
