"""Worker-side client of the job master: lease data-shard tasks, report them done or release their rest.

`lease()` returning None ends the worker's current epoch. Every call carries the job's bearer token and the worker's
launch generation (the master refuses older ones); connection errors, timeouts and 5xx answers are retried with
backoff, which is safe because done / release / lease are idempotent on the master; a 401 (wrong token) is not.
Endpoints: recforge.elastic.master.service.
Design: docs/fault_tolerance.md#data-shard-tasks.
"""
from __future__ import annotations

import functools
import logging
import os
import secrets
import ssl
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from recforge.elastic.master.tasks import Action, Task

log = logging.getLogger(__name__)


TOKEN_ENV = "RECFORGE_MASTER_TOKEN"
TOKEN_FILE_ENV = "RECFORGE_MASTER_TOKEN_FILE"
DEFAULT_WAIT_TIMEOUT_S = 600.0


class MasterUnavailableError(ConnectionError):
    """The job master could not be reached after all retries."""


class MasterAuthError(PermissionError):
    """The job master refused the token (HTTP 401); retrying cannot help."""


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for all clients of the process (httpx builds a new one per client otherwise: ~0.4 s)."""
    return ssl.create_default_context()


def read_token_file(path: str | Path) -> str:
    """The job master's token from a file (a Kubernetes Secret mount or `<state_dir>/master.token`)."""
    path = Path(path)
    try:
        token = path.read_text().strip()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"job master token file not found: {path}") from e
    if not token:
        raise ValueError(f"job master token file {path} is empty")
    return token


def write_token_file(path: str | Path, token: str | None = None) -> str:
    """Write `token` (None: a new random one) to `path`, mode 0600, temp file + rename; returns the token."""
    token = token or secrets.token_urlsafe(32)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return token


def resolve_token(token: str | None = None) -> str:
    """`token`, else env RECFORGE_MASTER_TOKEN, else the file named by env RECFORGE_MASTER_TOKEN_FILE."""
    if token:
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if os.environ.get(TOKEN_FILE_ENV):
        return read_token_file(os.environ[TOKEN_FILE_ENV])
    raise ValueError(f"no job master token: pass token=, or set {TOKEN_ENV} or {TOKEN_FILE_ENV} "
                     "(the file run_training_job writes, or the mounted Secret)")


class MasterClient:
    """The job master's client for one worker. `token`: see `resolve_token`. `generation` defaults to torchrun's
    TORCHELASTIC_RESTART_COUNT (else 0); a call is tried `max_attempts` times in all, with exponential backoff, then
    MasterUnavailableError; a 401 raises MasterAuthError at once. `wait_timeout_s` bounds a lease's WAIT loop."""

    def __init__(
        self,
        url: str,
        worker_id: str,
        *,
        token: str | None = None,
        generation: int | None = None,
        timeout_s: float = 10.0,
        max_attempts: int = 6,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        poll_interval_s: float = 0.5,
        wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be > 0, got {wait_timeout_s}")
        self.url = url.rstrip("/")
        self.worker_id = worker_id
        self.generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if generation is None else generation
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.poll_interval_s = poll_interval_s
        self.wait_timeout_s = wait_timeout_s
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, verify=_ssl_context(),
                                  headers={"Authorization": f"Bearer {resolve_token(token)}"})
        self._epoch: int | None = None
        self._finished = False

    # ---- protocol ------------------------------------------------------------------------
    @property
    def epoch(self) -> int | None:
        """The epoch this worker is in (None until the first answer from the master)."""
        return self._epoch

    @epoch.setter
    def epoch(self, value: int | None) -> None:
        self._epoch = value

    @property
    def finished(self) -> bool:
        """All epochs were done as of the last answer."""
        return self._finished

    def lease(self) -> Task | None:
        """The next task of this worker's epoch, or None exactly when that epoch has nothing TODO left: end it.

        A task may be a leftover of an older epoch that came back from a failed holder. After a None the client
        moves on to the next epoch by itself (`epoch`); once `finished`, lease() returns None at once. While the
        master still waits on in-flight tasks of the previous epoch (held by a worker that died outside this
        group), it polls every `poll_interval_s`; TimeoutError after `wait_timeout_s` naming the epoch it waited for."""
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            body = {
                "worker_id": self.worker_id,
                "epoch": self._epoch,
                "generation": self.generation,
                "request_id": uuid.uuid4().hex,
            }
            reply = self._post("/lease", body)
            action = Action(reply["action"])
            self._finished = bool(reply["finished"])
            if action is Action.TASK:
                if self._epoch is None:
                    self._epoch = int(reply["epoch"])
                return Task.model_validate(reply["task"])
            if action is Action.WAIT:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self.worker_id}: waited {self.wait_timeout_s}s for epoch {self._epoch} to start; the "
                        f"job master at {self.url} is still at epoch {reply['epoch']} with tasks in flight "
                        "(held by workers that neither finish nor time out)"
                    )
                time.sleep(self.poll_interval_s)
                continue
            if action is Action.FINISHED:
                self._epoch = int(reply["epochs"])
            else:  # END_EPOCH
                current = int(reply["epoch"]) if self._epoch is None else self._epoch
                self._epoch = current + 1
            return None

    def done(self, task_id: str, samples: int) -> bool:
        """Report the task fully consumed (`samples` real rows). False: the master rejected it
        (the lease had expired and the rows will be handed out again)."""
        reply = self._post(
            "/done",
            {"worker_id": self.worker_id, "task_id": task_id, "samples": samples, "generation": self.generation},
        )
        if not reply["accepted"]:
            log.warning("%s: done(%s) rejected by the master: %s", self.worker_id, task_id, reply["status"])
        return bool(reply["accepted"])

    def release(self, task_id: str, rows_consumed: int) -> bool:
        """Give back the unconsumed rest of a task; its first `rows_consumed` rows count as done."""
        reply = self._post(
            "/release",
            {"worker_id": self.worker_id, "task_id": task_id, "rows_consumed": rows_consumed,
             "generation": self.generation},
        )
        if not reply["accepted"]:
            log.warning("%s: release(%s) rejected by the master: %s", self.worker_id, task_id, reply["status"])
        return bool(reply["accepted"])

    def heartbeat(self, step: int) -> int:
        """Report progress and renew this worker's leases. Returns how many leases were renewed."""
        reply = self._post("/heartbeat", {"worker_id": self.worker_id, "step": step, "generation": self.generation})
        return int(reply["renewed"])

    def heartbeat_leases(self, step: int, held: list[str]) -> list[str]:
        """A heartbeat naming the leases this worker believes it holds: returns those it lost (expired
        or taken back; the master refuses to renew them)."""
        reply = self._post(
            "/heartbeat",
            {"worker_id": self.worker_id, "step": step, "generation": self.generation, "held": list(held)},
        )
        return list(reply.get("lost", []))

    def join(self) -> dict[str, Any]:
        """Register this worker (its launch generation locks older ones out); returns the queue summary."""
        return self._post("/join", {"worker_id": self.worker_id, "generation": self.generation})

    def snapshot(self, progress: dict[str, int]) -> dict[str, Any]:
        """The data state to store with a checkpoint: `progress` maps in-flight task ids to the rows of
        them the model was trained on (recforge.elastic.master.tasks.TaskQueue.snapshot)."""
        return self._post("/snapshot",
                          {"worker_id": self.worker_id, "generation": self.generation, "progress": progress})

    def restore(self, state: dict[str, Any] | None, reason: str = "") -> dict[str, Any]:
        """Roll the master's queue back to a checkpoint's data state (None: to the start)."""
        return self._post(
            "/restore", {"worker_id": self.worker_id, "generation": self.generation, "state": state, "reason": reason}
        )

    def command(self) -> dict[str, str]:
        """{command: continue | stop, reason}: whether the group should checkpoint and stop (a rescale)."""
        return self._post("/command", {"worker_id": self.worker_id, "generation": self.generation})

    def request_scale(self, workers: int, reason: str = "") -> dict[str, Any]:
        """Ask the job to relaunch at `workers` workers (rejected outside [1, the job's max_workers])."""
        return self._post("/scale", {"workers": workers, "reason": reason})

    def epoch_state(self) -> dict[str, Any]:
        """The master's state: epoch, epochs, finished, task counts, rows done, workers, poisoned tasks."""
        return self._request("GET", "/state", None)

    # ---- plumbing ------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        delay = self.backoff_s
        last: Exception | None = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                resp = self._http.request(method, path, json=body)
                if resp.status_code == 401:
                    raise MasterAuthError(
                        f"job master at {self.url} refused {method} {path} (HTTP 401): wrong or missing token; "
                        f"check {TOKEN_ENV} / {TOKEN_FILE_ENV} or the spec's master_token_file")
                if resp.status_code < 500:
                    if resp.status_code >= 400:
                        raise ValueError(f"job master {method} {path}: HTTP {resp.status_code}: {resp.text}")
                    return resp.json()
                last = RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            except httpx.TransportError as e:  # connect errors, timeouts, dropped connections
                last = e
            if attempt < self.max_attempts:
                log.info("%s: %s %s failed (%r), retry %d in %.2fs", self.worker_id, method, path, last, attempt, delay)
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
        raise MasterUnavailableError(
            f"job master at {self.url} unreachable: {method} {path} failed {self.max_attempts} times, "
            f"last error: {last!r}"
        )
