"""Rank 0's MLflow sink: metrics arrive in order off the training thread; a failing store never raises."""
from __future__ import annotations

import threading

from recforge.train.metrics_sink import AsyncMetricsSink


def test_metrics_are_logged_in_order_and_flushed_on_close():
    calls, threads = [], set()

    def fn(uri, run, metrics, step):
        threads.add(threading.current_thread().name)
        calls.append((uri, run, metrics, step))

    sink = AsyncMetricsSink(fn, "sqlite:///x.db", "run1")
    assert sink.log_now({"a": 0.0}, 0)
    for step in range(1, 6):
        sink({"train_loss": 1.0 / step}, step * 10)
    sink.close()
    assert [c[3] for c in calls] == [0, 10, 20, 30, 40, 50]
    assert calls[1] == ("sqlite:///x.db", "run1", {"train_loss": 1.0}, 10)
    assert "mlflow-metrics" in threads  # the queued ones were logged by the background thread


def test_a_failing_store_is_reported_once_and_never_raises(caplog):
    attempts = []

    def fn(uri, run, metrics, step):
        attempts.append(step)
        raise ConnectionError("store down")

    sink = AsyncMetricsSink(fn, "http://127.0.0.1:1", "run1")
    for step in range(3):
        sink({"x": 1.0}, step)
    sink.close()
    assert attempts == [0]  # after the first failure the rest is dropped
    assert sum("logging metrics to MLflow failed" in r.message for r in caplog.records) == 1
    assert not sink.log_now({"x": 1.0}, 9) and attempts == [0, 9]


def test_the_workers_tracking_log_fn_is_recforge_tracking():
    from recforge.worker.trainer import tracking_log_fn

    fn = tracking_log_fn()
    assert fn is not None and fn.__module__ == "recforge.tracking.metrics"
