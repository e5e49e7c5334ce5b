"""A bounded wait for an unreachable MLflow tracking server.

MLflow's client retries each HTTP request by itself (by default 7 times with exponential backoff: ~4 minutes,
then a generic "Max retries exceeded"). recforge shortens that per-request retry (3 tries, ~8 s, unless the user
set MLFLOW_HTTP_REQUEST_* themselves) and retries whole calls that failed because the server could not be
reached, until `RECFORGE_MLFLOW_WAIT_S` (default 120 s) have passed; then `TrackingUnavailable` names the server,
the call and how long it waited. Errors the server answered (a bad request, a missing run) are raised at once.
See docs/fault_tolerance.md (fault matrix).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import requests
from mlflow.exceptions import MlflowException

log = logging.getLogger(__name__)

WAIT_ENV = "RECFORGE_MLFLOW_WAIT_S"
DEFAULT_WAIT_S = 120.0
# MLflow's own per-request retry, shortened so the wait above is what bounds an outage (setdefault: a user's wins)
_MLFLOW_REQUEST_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                            "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
_UNREACHABLE_MARKS = ("Max retries exceeded", "Connection refused", "Connection aborted", "RemoteDisconnected",
                      "failed with timeout exception", "failed to return code 200", "too many 50")
_NETWORK_ERRORS = (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError, TimeoutError)

T = TypeVar("T")


class TrackingUnavailable(RuntimeError):
    """The tracking server could not be reached within the bounded wait; the message names it and the call."""


def bound_mlflow_request_retries() -> None:
    for k, v in _MLFLOW_REQUEST_DEFAULTS.items():
        os.environ.setdefault(k, v)


def wait_s() -> float:
    raw = os.environ.get(WAIT_ENV)
    if raw is None or raw == "":
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{WAIT_ENV}={raw!r}: expected seconds (a number >= 0)") from None
    if value < 0:
        raise ValueError(f"{WAIT_ENV}={raw!r}: expected seconds (a number >= 0)")
    return value


def unreachable(e: BaseException) -> bool:
    """True when `e` says the server could not be reached (no answer), not that it refused the request."""
    seen: BaseException | None = e
    for _ in range(5):  # MLflow wraps the requests error (as __context__ when raised inside `except`)
        if seen is None:
            break
        if isinstance(seen, _NETWORK_ERRORS):
            return True
        if isinstance(seen, MlflowException) and any(m in str(seen) for m in _UNREACHABLE_MARKS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def patiently(fn: Callable[..., T], what: str, uri: str, *args: Any, wait: float | None = None, **kw: Any) -> T:
    """`fn(*args, **kw)`, retried while the server at `uri` is unreachable, for at most `wait` seconds
    (default: wait_s()); then TrackingUnavailable naming `uri`, `what` and the last error."""
    budget = wait_s() if wait is None else wait
    start = time.monotonic()
    pause, warned = 1.0, False
    while True:
        try:
            result = fn(*args, **kw)
        except Exception as e:
            if not unreachable(e):
                raise
            waited = time.monotonic() - start
            if waited >= budget:
                raise TrackingUnavailable(
                    f"MLflow tracking server {uri} unreachable for {waited:.0f}s (the bound, {WAIT_ENV}, is "
                    f"{budget:.0f}s) while calling {what}: {str(e)[:300]}") from e
            if not warned:
                log.warning("MLflow tracking server %s unreachable during %s; retrying for up to %.0fs (%s)",
                            uri, what, budget, str(e)[:200])
                warned = True
            time.sleep(min(pause, max(budget - waited, 0.0)))
            pause = min(pause * 2, 10.0)
            continue
        if warned:
            log.warning("MLflow tracking server %s reachable again after %.1fs (%s)", uri,
                        time.monotonic() - start, what)
        return result


class PatientClient:
    """An MlflowClient whose every call goes through `patiently` (reads and writes alike)."""

    def __init__(self, client: Any, uri: str) -> None:
        self._client, self._uri = client, uri

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            return patiently(attr, f"MlflowClient.{name}", self._uri, *args, **kw)

        call.__name__ = name
        return call
