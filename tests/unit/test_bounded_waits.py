"""Every wait is bounded: each task of each DAG has an execution_timeout, the daily DAG's sized per stage and
overridable, and the training job has a finite default time limit that fits inside its task's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from recforge.config import PipelineConfig, ResourceConfig
from recforge.pipelines.dag_tasks import (
    STAGE_TIMEOUTS_S,
    TRAIN_MARGIN_S,
    ParamError,
    config_from_params,
    stage_timeout,
    timeout_env,
)
from recforge.pipelines.runner import STAGES
from recforge.settings import embedded_env

REPO = Path(__file__).resolve().parents[2]


def _airflow_env(home: Path) -> dict[str, str]:
    """This checkout's embedded Airflow settings under `home` (no database needed to parse DAG files)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "RECFORGE_TIMEOUT_"))}
    return {**env, **embedded_env(home)}


def test_every_task_of_every_dag_has_an_execution_timeout(tmp_path):
    code = (
        "import json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(REPO / 'dags')!r})\n"
        "print(json.dumps({'errors': {k: str(v) for k, v in bag.import_errors.items()},\n"
        "  'timeouts': {d.dag_id: {t.task_id: t.execution_timeout and t.execution_timeout.total_seconds()\n"
        "                          for t in d.tasks} for d in bag.dags.values()}}))\n"
    )
    env = {**_airflow_env(tmp_path), timeout_env("evaluate"): "123"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["errors"] == {}
    timeouts = info["timeouts"]
    assert {"recforge_daily", "recforge_train_k8s"} <= set(timeouts)
    missing = [f"{dag}.{task}" for dag, tasks in timeouts.items() for task, t in tasks.items() if not t]
    assert missing == [], f"tasks without an execution_timeout: {missing}"
    daily = timeouts["recforge_daily"]
    assert set(daily) == {"wait_for_data", *STAGES} == set(STAGE_TIMEOUTS_S)
    # the landing sensor's own timeout (at most 7 days, a Param) fails it first, naming what is missing
    assert daily["wait_for_data"] > PipelineConfig.model_fields["sensor_timeout_s"].metadata[-1].le
    assert daily == {**STAGE_TIMEOUTS_S, "evaluate": 123.0}  # sized per stage; the environment overrides one
    assert daily["train"] == ResourceConfig().job_timeout_s + TRAIN_MARGIN_S  # the job's own limit fits inside


def test_a_stage_timeout_from_the_environment_is_checked(monkeypatch):
    monkeypatch.setenv("RECFORGE_TIMEOUT_COMPILE_S", "90")
    assert stage_timeout("compile") == timedelta(seconds=90)
    for bad in ("0", "-5", "ten", "inf"):
        monkeypatch.setenv("RECFORGE_TIMEOUT_COMPILE_S", bad)
        with pytest.raises(ValueError, match=f"RECFORGE_TIMEOUT_COMPILE_S='{bad}': the execution_timeout of task "
                                             "'compile' must be a number of seconds > 0"):
            stage_timeout("compile")
    with pytest.raises(KeyError, match="no execution_timeout for task 'serve'"):
        stage_timeout("serve")


def test_the_training_job_limit_is_finite_and_must_fit_inside_the_train_task(monkeypatch):
    assert 0 < PipelineConfig().resources.job_timeout_s < float("inf")
    assert config_from_params({"job_timeout_s": 600}) == {"resources": {"job_timeout_s": 600}}
    monkeypatch.setenv(timeout_env("train"), "3600")
    with pytest.raises(ParamError, match=r"param 'job_timeout_s': must be <= 1800, got 14400.0 \(the train task's "
                                         r"execution_timeout 3600 s less 1800 s .*RECFORGE_TIMEOUT_TRAIN_S raises it"):
        config_from_params({"job_timeout_s": 14400.0})
    with pytest.raises(ParamError, match=r"param 'job_timeout_s': must be > 0"):
        config_from_params({"job_timeout_s": 0})
