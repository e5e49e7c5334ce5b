"""recforge's Airflow executor: LocalExecutor whose worker processes import the daily pipeline's task stack once.

Airflow 3's LocalExecutor runs every task in a bare ``os.fork()`` of one of its long-lived worker processes. A task
of recforge_daily then spends 5-9 s importing torch, TorchRec, MLflow and recforge's stages before its stage starts.
These workers import that stack when they start, before they take a task, so every task they fork inherits it
(docs/architecture.md#task-start-up). The scheduler itself stays lean: only its workers hold the stack.

Selected by AIRFLOW__CORE__EXECUTOR (scripts/env.sh, recforge.settings); importing this module stays cheap, as the
api-server and the scheduler import it to resolve the executor.
"""
from __future__ import annotations

import importlib
import logging
import multiprocessing
import time

from airflow.executors import local_executor
from airflow.executors.local_executor import LocalExecutor

log = logging.getLogger("recforge.pipelines.task_executor")

# What recforge_daily's tasks import: the DAG file's imports, the stage modules and every module they import inside
# their functions (tests/unit/test_task_executor.py checks that list against the code), and the libraries beneath.
TASK_STACK: tuple[str, ...] = (
    "torch", "fbgemm_gpu", "torchrec", "torch.distributed.checkpoint", "mlflow", "numpy", "pyarrow.parquet",
    "scipy.stats", "scipy.optimize", "matplotlib.figure",
    "airflow.sdk",
    "recforge.pipelines.dag_tasks", "recforge.pipelines.landing_sensor", "recforge.pipelines.runner",
    "recforge.pipelines.holdout", "recforge.pipelines.hooks.data_stats", "recforge.pipelines.hooks.rap_planning",
    "recforge.pipelines.hooks.rap_training", "recforge.pipelines.hooks.resource_planning",
    "recforge.data.generator", "recforge.data.ingest", "recforge.data.shards", "recforge.data.binned_auc",
    "recforge.preprocess.executor", "recforge.preprocess.module", "recforge.preprocess.planning.plan",
    "recforge.recom", "recforge.recom.inference", "recforge.recom.report", "recforge.recom.serving",
    "recforge.tracking.registry", "recforge.train.metrics", "recforge.train.loop.batches",
    "recforge.train.loop.ledger", "recforge.train.recovery.checkpoint", "recforge.elastic.agent.client",
)


def preload(modules: tuple[str, ...] = TASK_STACK) -> dict[str, str]:
    """Import `modules`; returns {module: error} for those that failed. A failure is logged and skipped: the task
    that needs the module imports it again and fails there with its real error, in its own log."""
    started = time.monotonic()
    failed: dict[str, str] = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import error is the task's to report, not the worker's
            failed[name] = f"{type(exc).__name__}: {exc}"
            log.warning("recforge task stack: could not preload %s (%s)", name, failed[name])
    log.info("recforge task stack preloaded: %d of %d modules in %.1f s (pid %d)", len(modules) - len(failed),
             len(modules), time.monotonic() - started, multiprocessing.current_process().pid)
    return failed


def _preloading_worker(**worker_kwargs) -> None:
    """A LocalExecutor worker that imports the task stack first, then takes tasks as Airflow's own does."""
    preload()
    local_executor._run_worker(**worker_kwargs)


class PreloadingLocalExecutor(LocalExecutor):
    """LocalExecutor whose workers start with the task stack imported (module docstring)."""

    def _spawn_worker(self) -> None:
        # Airflow 3.3's LocalExecutor._spawn_worker with the preloading target: the same arguments, the same process
        process = multiprocessing.Process(
            target=_preloading_worker,
            kwargs={
                "logger_name": self.log.name,
                "input": self.activity_queue,
                "output": self.result_queue,
                "unread_messages": self._unread_messages,
                "team_conf": self.conf,
            },
        )
        process.start()
        assert process.pid is not None  # started
        self.workers[process.pid] = process
