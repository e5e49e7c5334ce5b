"""Rank 0's training metrics to a tracking store (a LogFn, e.g. recforge.tracking.metrics.log_metrics) off the
training thread.

A tracking store that is slow or down must neither stall the step loop (the other ranks wait for
rank 0 at the next collective) nor kill the job: metrics go through a queue to a background thread,
failures are logged once and then dropped.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

LogFn = Callable[[str, str, dict[str, float], int], None]


class AsyncMetricsSink:
    """Callable (metrics, step) -> None; `close()` flushes what is queued (bounded by a timeout)."""

    def __init__(self, log_fn: LogFn, tracking_uri: str, run_id: str) -> None:
        self._fn, self._uri, self._run = log_fn, tracking_uri, run_id
        self._q: queue.Queue = queue.Queue()
        self._failed = False
        self._thread = threading.Thread(target=self._drain, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def log_now(self, metrics: dict[str, float], step: int) -> bool:
        """Log synchronously (e.g. once before training, so connecting to the store is not timed)."""
        try:
            self._fn(self._uri, self._run, dict(metrics), int(step))
            return True
        except Exception as e:
            self._failed = True
            log.warning("logging metrics to MLflow failed (%r); no more metrics from this worker", e)
            return False

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        self._q.put((dict(metrics), int(step)))

    def _drain(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._failed:
                continue
            metrics, step = item
            try:
                self._fn(self._uri, self._run, metrics, step)
            except Exception as e:  # tracking trouble must not kill a training job
                self._failed = True
                log.warning("logging metrics to MLflow failed (%r); no more metrics from this worker", e)

    def close(self, timeout_s: float = 60.0) -> None:
        self._q.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("MLflow metrics not flushed within %.0fs; dropping the rest", timeout_s)
