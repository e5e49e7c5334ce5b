"""The bounded wait for an unreachable MLflow server (recforge.tracking.outage), against a real closed port."""
from __future__ import annotations

import socket

import pytest
from mlflow.exceptions import MlflowException

from recforge.tracking.outage import WAIT_ENV, TrackingUnavailable, patiently, unreachable, wait_s


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: connections are refused


def test_an_unreachable_server_fails_after_the_bound_naming_server_and_call(monkeypatch):
    from recforge.tracking.metrics import log_metrics

    uri = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv(WAIT_ENV, "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(TrackingUnavailable) as err:
        log_metrics(uri, "0" * 32, {"loss": 1.0}, step=1)
    msg = str(err.value)
    assert uri in msg and "MlflowClient.log_batch" in msg and WAIT_ENV in msg and "unreachable" in msg
    assert unreachable(err.value.__cause__)


def test_an_answered_error_is_raised_at_once_not_waited_for(monkeypatch, tmp_path, mlflow_db):
    from recforge.tracking.store import TrackingStore

    monkeypatch.setenv(WAIT_ENV, "3600")  # would hang the test if an answered error were retried
    store = TrackingStore(mlflow_db(tmp_path / "mlflow.db"), tmp_path / "artifacts")
    with pytest.raises(MlflowException) as err:
        store.client.get_run("f" * 32)
    assert not isinstance(err.value, TrackingUnavailable) and not unreachable(err.value)


def test_a_call_that_recovers_within_the_bound_returns_its_result():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError("server restarting")
        return "ok"

    assert patiently(flaky, "flaky()", "http://mlflow", wait=30) == "ok" and len(calls) == 3


@pytest.mark.parametrize("raw", ["soon", "-1"])
def test_a_bad_wait_setting_is_named(monkeypatch, raw):
    monkeypatch.setenv(WAIT_ENV, raw)
    with pytest.raises(ValueError, match=f"{WAIT_ENV}={raw!r}"):
        wait_s()
