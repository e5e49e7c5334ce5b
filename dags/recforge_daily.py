"""recforge_daily: ingest -> plan -> train -> evaluate -> compile -> publish, once a day.

Wiring only: every task calls a function in recforge.pipelines, which imports the heavy
libraries (torch, torchrec, mlflow) inside the task, so parsing this file stays fast.
"""
from __future__ import annotations

from itertools import pairwise

import pendulum
from airflow.sdk import Param, dag, get_current_context, task

from recforge.pipelines.dag_tasks import default_params, run_stage_from_context


def _stage(name: str):
    @task(task_id=name)
    def run() -> dict:
        return run_stage_from_context(name, get_current_context())

    return run()


@dag(
    dag_id="recforge_daily",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": pendulum.duration(seconds=30)},
    params={name: Param(**spec) for name, spec in default_params().items()},
    tags=["recforge"],
    doc_md=__doc__,
)
def recforge_daily():
    stages = [_stage(n) for n in ("generate", "ingest", "plan_resources", "train", "evaluate", "compile", "publish")]
    for upstream, downstream in pairwise(stages):
        upstream >> downstream


recforge_daily()
