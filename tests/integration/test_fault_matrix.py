"""Faults of the fault matrix not covered elsewhere, at the smallest size (docs/fault_tolerance.md, fault matrix).

The MLflow tracking server stopped for a few seconds while a stage and a worker log (`recforge bench faults`
stops it for 30 s mid-training): both wait, bounded, and resume logging; every step is logged exactly once.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_an_mlflow_outage_delays_logging_and_nothing_is_lost_or_logged_twice(tmp_path, monkeypatch, mlflow_db):
    from recforge.pipelines.faults import MlflowServer
    from recforge.tracking.metrics import log_metrics
    from recforge.tracking.store import TrackingStore
    from recforge.train.metrics_sink import AsyncMetricsSink

    monkeypatch.setenv("RECFORGE_MLFLOW_WAIT_S", "120")
    # the server's store, a copy of the migrated template: a new store would run every MLflow migration at its start
    mlflow_db(tmp_path / "mlflow" / "mlflow.db")
    server = MlflowServer(tmp_path / "mlflow")
    server.start()
    try:
        store = TrackingStore(server.uri, tmp_path / "artifacts")
        run_id = store.stage_run("fault_matrix", "outage", "train")
        sink = AsyncMetricsSink(log_metrics, server.uri, run_id)
        for step in range(1, 6):
            sink({"train_loss": 1.0 / step}, step)
        sink.close(timeout_s=60)  # flushed: steps 1-5 are in before the outage
        sink = AsyncMetricsSink(log_metrics, server.uri, run_id)

        server.stop()
        outage = server.outage(after_s=0.0, down_s=1.0)  # already down; starting again in 1 s (and the start's seconds)
        for step in range(6, 11):  # the worker keeps training: its metrics queue up
            sink({"train_loss": 1.0 / step}, step)
        store.log_metrics(run_id, {"rows": 123.0}, step=0)  # made while the server is down: it waits for it
        outage.join(timeout=200)
        sink.close(timeout_s=120)
        store.finish(run_id)

        client = store.client
        steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
        assert sorted(steps) == list(range(1, 11))  # resumed, nothing lost, nothing twice
        assert client.get_run(run_id).data.metrics["rows"] == 123.0
        assert client.get_run(run_id).info.status == "FINISHED"
        assert server.starts == 2  # it was down, and came back
    finally:
        server.stop()
