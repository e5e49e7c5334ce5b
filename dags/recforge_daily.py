"""recforge_daily: wait for the day's data -> generate -> ingest -> plan -> train -> evaluate -> compile -> publish,
once a day.

wait_for_data (recforge.pipelines.landing_sensor) waits, deferred to the triggerer, until the run's landing files
(Param source_uri, e.g. /data/landing/day_{ds}.tsv.gz) have landed: the train_days days ending with the run's day,
and with holdout next_day the day after; it fails after sensor_timeout_s naming the missing paths. With source_uri
empty the run uses synthetic days. `airflow backfill create --dag-id recforge_daily --from-date A --to-date B` runs
each day of a range once; re-running a day replaces its outputs.

Wiring only: every task calls a function in recforge.pipelines, which imports the heavy
libraries (torch, torchrec, mlflow) inside the task, so parsing this file stays fast.

Every Param is a PipelineConfig field (recforge.pipelines.dag_tasks.PARAM_FIELDS): its default, type, bounds,
enum and description are read off the config. A conf key the DAG does not know, or a value of the wrong type or
out of range, fails the task at once naming the Param; invalid input is never retried, other failures are
retried once. A failed or cancelled task closes its MLflow runs as FAILED with the reason (tag recforge.error).
Every task has an execution_timeout sized to its stage (recforge.pipelines.dag_tasks.STAGE_TIMEOUTS_S;
RECFORGE_TIMEOUT_<TASK>_S overrides one).
"""
from __future__ import annotations

import os
from itertools import pairwise

import pendulum
from airflow.sdk import Param, dag, get_current_context, task
from airflow.timetables.interval import CronDataIntervalTimetable

from recforge.pipelines.dag_tasks import close_open_runs, default_params, run_stage_from_context, stage_timeout
from recforge.pipelines.landing_sensor import wait_for_data


def _stage(name: str):
    @task(task_id=name, execution_timeout=stage_timeout(name))
    def run() -> dict:
        return run_stage_from_context(name, get_current_context())

    return run()


@dag(
    dag_id="recforge_daily",
    # data intervals: the run scheduled at midnight processes the day that just ended (its logical date), whose
    # landing file is complete; with holdout next_day it then waits for the following day's file (sensor_timeout_s)
    schedule=CronDataIntervalTimetable("@daily", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    # RECFORGE_RETRY_DELAY_S: the end-to-end tests' services shorten the wait before a retry (default 30 s)
    default_args={"retries": 1, "retry_delay": pendulum.duration(seconds=int(os.environ.get("RECFORGE_RETRY_DELAY_S",
                                                                                            "30")))},
    params={name: Param(**spec) for name, spec in default_params().items()},
    # a task process killed outright (SIGKILL, OOM) cannot close its MLflow runs; the failed DAG run's callback does
    on_failure_callback=close_open_runs,
    tags=["recforge"],
    doc_md=__doc__,
)
def recforge_daily():
    stages = [wait_for_data(execution_timeout=stage_timeout("wait_for_data"))]
    stages += [_stage(n) for n in ("generate", "ingest", "plan_resources", "train", "evaluate", "compile", "publish")]
    for upstream, downstream in pairwise(stages):
        upstream >> downstream


recforge_daily()
