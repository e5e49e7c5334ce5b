"""Metric logging for training workers (a separate process that only knows the run id). An unreachable server is
waited for, bounded (recforge.tracking.outage), so a short outage only delays the metrics."""
from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric

from recforge.tracking.outage import PatientClient, bound_mlflow_request_retries


@lru_cache(maxsize=4)
def _client(tracking_uri: str) -> Any:
    bound_mlflow_request_retries()
    return PatientClient(MlflowClient(tracking_uri=tracking_uri), tracking_uri)


def log_metric_batch(client: Any, run_id: str, metrics: dict[str, float], step: int) -> None:
    """One MLflow batch of `metrics` at `step`, all stamped now; nothing is sent for an empty dict."""
    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
    if batch:
        client.log_batch(run_id, metrics=batch)


def log_metrics(tracking_uri: str, run_id: str, metrics: dict[str, float], step: int) -> None:
    """Log `metrics` at `step` into run `run_id` of the store at `tracking_uri` (one cached client per URI)."""
    log_metric_batch(_client(tracking_uri), run_id, metrics, step)


def last_logged_step(tracking_uri: str, run_id: str, key: str) -> int | None:
    """The highest step of metric `key` in run `run_id` (None: not logged yet): where a resumed group continues."""
    history = _client(tracking_uri).get_metric_history(run_id, key)
    return max((m.step for m in history), default=None)
