"""The job master: one HTTP service per training job handing out data-shard tasks (recforge.elastic.master.tasks).

Every request carries `Authorization: Bearer <the job's token>` (401 otherwise) and a body of at most
`max_body_bytes` (413). Endpoints (JSON bodies, strictly typed: 422 for a wrong type or an unknown field;
`generation` is the caller's launch generation; a refused call changes nothing and answers 404 for an unknown
worker, 409 for an older generation, 422 for a scale outside [1, max_workers], 400 for a bad data state):
  POST /lease      {worker_id, epoch?, generation, request_id?}     -> {action, task?, epoch, epochs, finished}
  POST /done       {worker_id, task_id, samples, generation}        -> {accepted, status}
  POST /release    {worker_id, task_id, rows_consumed, generation}  -> {accepted, status}
  POST /heartbeat  {worker_id, step, generation, held?}             -> {renewed, lost}
  POST /join       {worker_id, generation}                          -> queue summary (registers the worker)
  POST /snapshot   {worker_id, generation, progress}                -> data state for a checkpoint (no change)
  POST /restore    {worker_id, generation, state?, reason}          -> queue rolled back to a checkpoint's data state
  POST /scale      {workers, reason}                                -> {workers} (a pending scale request)
  POST /command    {worker_id, generation}                          -> {command: continue | stop, reason}
  POST /recover    {worker_id?}                                     -> {requeued, poisoned}
  GET  /state                                                       -> queue summary + workers
Persistence (snapshot + append-only log, recforge.elastic.master.state_log), auth, lease expiry, epochs and
generations: docs/fault_tolerance.md#data-shard-tasks.
"""
from __future__ import annotations

import gc
import hmac
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from recforge.data.manifest import shard_rows_from_manifest
from recforge.elastic.master.state_log import MASTER_STATE_VERSION, StateLog, dumps
from recforge.elastic.master.tasks import Action, Grant, Outcome, Requeued, Task, TaskQueue

log = logging.getLogger(__name__)

__all__ = ["MASTER_STATE_VERSION", "JobMaster", "MasterRejection", "ScaleRejectedError", "StaleGenerationError",
           "UnknownWorkerError", "shard_rows_from_manifest"]

COMPACTOR_WAIT_S = 60.0  # how long stop() waits for a snapshot child before killing it
MIN_BODY_BYTES = 1 << 20  # the body limit's floor; a job's /restore data state may need more (see JobMaster)


class MasterRejection(ValueError):
    """A call the master refuses; nothing changed. `http_status` is what the HTTP API answers."""

    http_status = 400


class UnknownWorkerError(MasterRejection):
    http_status = 404


class StaleGenerationError(MasterRejection):
    http_status = 409


class ScaleRejectedError(MasterRejection):
    http_status = 422


@dataclass
class WorkerStats:
    tasks_done: int = 0
    samples: int = 0
    leases: int = 0
    releases: int = 0
    rejected: int = 0
    step: int | None = None
    last_seen: float | None = None
    generation: int = 0


_STRICT = ConfigDict(strict=True, extra="forbid")
_ID = Field(min_length=1, max_length=256)


class WorkerCall(BaseModel):
    """Who calls: every worker call names its id and its launch generation (POST /join, /command)."""

    model_config = _STRICT
    worker_id: str = _ID
    generation: int = Field(0, ge=0)


class LeaseRequest(WorkerCall):
    epoch: int | None = Field(None, ge=0)
    request_id: str | None = Field(None, max_length=256)


class DoneRequest(WorkerCall):
    task_id: str = _ID
    samples: int = Field(ge=0)


class ReleaseRequest(WorkerCall):
    task_id: str = _ID
    rows_consumed: int = Field(ge=0)


class HeartbeatRequest(WorkerCall):
    step: int = Field(ge=0)
    held: list[str] | None = None


class SnapshotRequest(WorkerCall):
    progress: dict[str, int] = Field(default_factory=dict)


class RestoreRequest(WorkerCall):
    state: dict[str, Any] | None = None
    reason: str = Field("", max_length=4096)


class ScaleRequest(BaseModel):
    model_config = _STRICT
    workers: int
    reason: str = Field("", max_length=4096)


class RecoverRequest(BaseModel):
    model_config = _STRICT
    worker_id: str | None = Field(None, min_length=1, max_length=256)


class JobMaster:
    """Data-shard task service of one job. Use as a context manager or call start() / stop()."""

    def __init__(
        self,
        shard_rows: Sequence[int],
        *,
        rows_per_task: int,
        epochs: int = 1,
        state_file: str | Path | None = None,
        lease_timeout_s: float = 120.0,
        max_retries: int = 3,
        shuffle_seed: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        expiry_interval_s: float = 1.0,
        new_launch: bool = False,
        clock: Callable[[], float] = time.time,
        max_workers: int | None = None,
        advertise_host: str | None = None,
        token: str | None = None,
        max_body_bytes: int | None = None,
        snapshot_interval_s: float = 1.0,
    ) -> None:
        """`new_launch=True`: leases restored from `state_file` belong to workers that are gone
        (the caller is about to launch new ones), so they go back to TODO at once; otherwise each restored
        lease gets a full `lease_timeout_s` from now (heartbeat renewals are not persisted).
        `max_workers`: the largest world size a scale request may ask for (None: no upper limit).
        `advertise_host`: the address workers use in `url` when it differs from the bind `host` (0.0.0.0).
        `token`: the bearer token every request must carry (None: a new random one; read it from `token`).
        `max_body_bytes`: the largest request body (None: 1 MiB, or more when this job's /restore data state
        can be larger). `snapshot_interval_s`: how often the state file's snapshot is rewritten (when changed)."""
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if token is not None and len(token) < 16:
            raise ValueError("token: must be at least 16 characters (use secrets.token_urlsafe(32))")
        if snapshot_interval_s <= 0:
            raise ValueError(f"snapshot_interval_s must be > 0, got {snapshot_interval_s}")
        self._token = token if token is not None else secrets.token_urlsafe(32)
        self._lock = threading.Lock()
        self._clock = clock
        self.max_workers = max_workers
        self.pending_scale: dict[str, Any] | None = None
        self.scale_check: Callable[[int], None] | None = None  # extra validation (the supervisor's), raises ValueError
        self.progress_at = clock()  # last sign of training progress (see _progress)
        self.host = host
        self.advertise_host = advertise_host or host
        self._requested_port = port
        self.expiry_interval_s = expiry_interval_s
        self.snapshot_interval_s = snapshot_interval_s
        self.state_file = Path(state_file) if state_file is not None else None
        self.workers: dict[str, WorkerStats] = {}
        self._last_lease: dict[str, tuple[str, Grant]] = {}
        fresh = TaskQueue(
            shard_rows, rows_per_task, epochs,
            lease_timeout_s=lease_timeout_s, max_retries=max_retries, shuffle_seed=shuffle_seed,
        )
        # a restore's data state is about one JSON record (~250 bytes) per task, more after releases
        self.max_body_bytes = int(max_body_bytes or max(MIN_BODY_BYTES, 1024 * fresh.tasks_per_epoch + 65536))
        self._log = StateLog(self.state_file) if self.state_file is not None else None
        self.restored = self._log is not None and self._log.exists()
        self.queue = self._restore(fresh, new_launch) if self.restored else fresh
        if new_launch:
            self._note(self.queue.new_launch(), "new launch")
        self._recs: dict[str, dict[str, Any]] = {}  # task id -> its record as last logged (this epoch); _compact
        self._changed = False  # anything to compact
        self._log_broken = False  # an append failed: the next compaction writes everything
        self._compactor: int | None = None  # pid of the child writing a snapshot (_compact)
        if self._log is not None:
            self.queue.track_changes()
            self._full_snapshot()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._ticker: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self.port: int | None = None
        self.app = self._build_app()

    @classmethod
    def from_manifest(cls, manifest_dir: str | Path, **kwargs: Any) -> JobMaster:
        return cls(shard_rows_from_manifest(manifest_dir), **kwargs)

    @property
    def token(self) -> str:
        """The bearer token of this job (never log it)."""
        return self._token

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("JobMaster.url: the master is not started")
        return f"http://{self.advertise_host}:{self.port}"

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self, timeout_s: float = 15.0) -> JobMaster:
        if self._thread is not None:
            raise RuntimeError("JobMaster.start: already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._requested_port))
        self.port = sock.getsockname()[1]
        self._sock = sock  # owned by uvicorn's asyncio server while it runs; closed again in stop()
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", backlog=4096)
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="recforge-job-master", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"JobMaster: server did not start on {self.host}:{self.port} within {timeout_s}s")
            time.sleep(0.01)
        self._stop.clear()
        self._ticker = threading.Thread(target=self._tick, name="recforge-job-master-expiry", daemon=True)
        self._ticker.start()
        log.info("job master listening on %s (state file %s)", self.url, self.state_file)
        return self

    @property
    def stopping(self) -> bool:
        """stop() was called: the job is shutting down (its supervisor relaunches nothing)."""
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._ticker is not None:
            self._ticker.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._ticker = self._sock = None
        if self._log is not None:
            with self._lock:
                self._full_snapshot()

    def __enter__(self) -> JobMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- operations (the endpoints call these; usable in-process too) ------------------------
    def lease(self, worker_id: str, epoch: int | None = None, generation: int = 0,
              request_id: str | None = None) -> Grant:
        with self._lock:
            self._check(worker_id, generation, register=True)
            stats = self._admit(worker_id, generation)
            if request_id is not None:
                last = self._last_lease.get(worker_id)
                if last is not None and last[0] == request_id:
                    self._commit()
                    return last[1]  # a retried request whose answer was lost: same answer
            grant = self.queue.request(worker_id, self._clock(), epoch, generation)
            extra: list[list[Any]] = []
            if request_id is not None:
                self._last_lease[worker_id] = (request_id, grant)
                if self._log is not None:
                    extra.append(["lease", [worker_id, request_id, grant_json(grant)]])
            if grant.action is Action.TASK:
                stats.leases += 1
            self._commit(worker_id, extra=extra)
            return grant

    def done(self, worker_id: str, task_id: str, samples: int, generation: int = 0) -> Outcome:
        return self._report("done", worker_id, generation, task_id, samples)

    def release(self, worker_id: str, task_id: str, rows_consumed: int, generation: int = 0) -> Outcome:
        return self._report("release", worker_id, generation, task_id, rows_consumed)

    def _report(self, kind: str, worker_id: str, generation: int, task_id: str, rows: int) -> Outcome:
        """A task finished (`done`, its `rows` trained) or handed back with `rows` of it trained (`release`)."""
        with self._lock:
            self._check(worker_id, generation)
            stats = self._admit(worker_id, generation)
            out = (self.queue.done(task_id, worker_id) if kind == "done"
                   else self.queue.release(task_id, worker_id, rows))
            if out is Outcome.ACCEPTED:
                if kind == "done":
                    stats.tasks_done += 1
                else:
                    stats.releases += 1
                stats.samples += rows
                self._progress()
            elif not out.ok:
                stats.rejected += 1
                log.warning("%s(%s) from %s rejected: %s", kind, task_id, worker_id, out.value)
            self._commit(worker_id if out is not Outcome.DUPLICATE else None)
            return out

    def heartbeat(self, worker_id: str, step: int, generation: int = 0) -> int:
        return self.heartbeat_leases(worker_id, step, generation)[0]

    def heartbeat_leases(
        self, worker_id: str, step: int, generation: int = 0, held: Sequence[str] | None = None
    ) -> tuple[int, list[str]]:
        """Renew the worker's leases: (how many were renewed, which of `held` it no longer holds).
        Renewals and the step are not logged (a restarted master grants leases a fresh deadline)."""
        with self._lock:
            self._check(worker_id, generation)
            stats = self._admit(worker_id, generation)
            if stats.step is None or step > stats.step:
                self._progress()
            stats.step = step
            renewed = self.queue.renew(worker_id, self._clock())
            lost: list[str] = []
            if held:
                holding = set(self.queue.held_by(worker_id))
                lost = sorted(t for t in held if t not in holding)
            if lost:
                log.warning("heartbeat from %s: leases %s expired or were taken back; not renewed", worker_id, lost)
            self._commit()
            return renewed, lost

    def join(self, worker_id: str, generation: int = 0) -> dict[str, Any]:
        """A worker of launch generation `generation` starts: register it (its calls are accepted from now)."""
        with self._lock:
            self._check(worker_id, generation, register=True)
            self._admit(worker_id, generation)
            self._progress()
            self._commit(worker_id)
            return self.queue.summary()

    def snapshot(self, worker_id: str, generation: int, progress: dict[str, int]) -> dict[str, Any]:
        """The data state for a checkpoint taken now (`TaskQueue.snapshot`); changes nothing."""
        with self._lock:
            self._check(worker_id, generation)
            doc = self.queue.snapshot(progress)  # bad progress raises before anything changes
            self._admit(worker_id, generation)
            self._commit()
            return doc

    def restore(self, worker_id: str, generation: int, state: dict[str, Any] | None,
                reason: str = "") -> dict[str, Any]:
        """Roll the queue back to a checkpoint's data state (None: to the very start: the model starts
        from its initial weights, so no row counts as trained). Called by rank 0 of a (re)started group
        before any rank leases; older generations are locked out from now on."""
        with self._lock:
            self._check(worker_id, generation, register=True)
            fresh = self.queue.restarted()
            queue = fresh if state is None else self._checked_queue(TaskQueue.from_dict(state), fresh, "restore")
            self._admit(worker_id, generation)
            before = self.queue.summary()
            queue.lease_timeout_s, queue.max_retries = fresh.lease_timeout_s, fresh.max_retries
            queue.recover(None)  # a checkpoint's state has no lease in flight (TaskQueue.snapshot); be safe anyway
            queue.generation = max(self.queue.generation, generation)
            self.queue.drain_changes()  # superseded by the whole queue below
            self.queue = queue
            self._last_lease.clear()
            extra: list[list[Any]] = []
            if self._log is not None:
                queue.track_changes()
                doc = queue.to_dict()
                self._recs = {r["task"]["task_id"]: r for r in doc["records"]}
                extra = [["queue", doc], ["lease_clear", True]]
            after = queue.summary()
            redo = before["rows_done_total"] - after["rows_done_total"]
            log.log(
                logging.WARNING if state is not None or redo > 0 else logging.INFO,
                "data state restored (%s) by %s of generation %d: epoch %d, %d rows done; %d row(s) the master "
                "had counted done are not in that checkpoint and will be trained again",
                reason or ("checkpoint" if state is not None else "no checkpoint: from the start"),
                worker_id, generation, after["epoch"], after["rows_done_total"], max(redo, 0),
            )
            self._progress()
            self._commit(worker_id, extra=extra)
            return {**after, "rows_redone": max(redo, 0)}

    def request_scale(self, workers: int, reason: str = "") -> dict[str, Any]:
        """Ask the running group to checkpoint and stop so the job relaunches at `workers` workers."""
        with self._lock:
            if workers < 1:
                raise ScaleRejectedError(f"scale request: workers={workers} is below the minimum of 1 worker")
            if self.max_workers is not None and workers > self.max_workers:
                raise ScaleRejectedError(
                    f"scale request: workers={workers} is above this job's limit of max_workers={self.max_workers}")
            if self.queue.finished:
                raise ScaleRejectedError("scale request: the job is finished; nothing to scale")
            if self.scale_check is not None:
                try:
                    self.scale_check(workers)
                except ValueError as e:
                    raise ScaleRejectedError(f"scale request: workers={workers}: {e}") from e
            self.pending_scale = {"workers": int(workers), "reason": reason, "time": self._clock()}
            log.info("scale to %d worker(s) requested: %s", workers, reason or "(no reason given)")
            self._commit(extra=[["scale", dict(self.pending_scale)]])
            return dict(self.pending_scale)

    def take_scale(self) -> dict[str, Any] | None:
        """The pending scale request, cleared (the supervisor calls this when it relaunches)."""
        with self._lock:
            req, self.pending_scale = self.pending_scale, None
            self._commit(extra=[["scale", None]] if req is not None else [])
            return req

    def command(self, worker_id: str, generation: int = 0) -> dict[str, str]:
        """What the group should do at its next checkpoint boundary."""
        with self._lock:
            self._check(worker_id, generation)
            self._admit(worker_id, generation)
            self._commit()
            if self.pending_scale is not None:
                return {"command": "stop", "reason": f"rescale to {self.pending_scale['workers']} worker(s)"}
            return {"command": "continue", "reason": ""}

    def touch_progress(self) -> None:
        """Restart the hang clock (the supervisor calls this when it launches a group)."""
        with self._lock:
            self._progress()

    def progress_age(self) -> float:
        """Seconds since the last sign of training progress (a done, a release, a heartbeat with a higher
        step, a worker joining or a restore)."""
        with self._lock:
            return self._clock() - self.progress_at

    def recover(self, worker_id: str | None = None) -> Requeued:
        """Take back the leases of a worker known to be dead (all when None)."""
        with self._lock:
            out = self.queue.recover(worker_id)
            self._note(out, f"recover({worker_id})")
            self._commit()
            return out

    def state(self) -> dict[str, Any]:
        with self._lock:
            self._note(self.queue.expire(self._clock()), "expired")
            self._commit()
            s = self.queue.summary()
            s["workers"] = {w: asdict(st) for w, st in sorted(self.workers.items())}
            s["samples"] = sum(st.samples for st in self.workers.values())
            s["tasks_done"] = sum(st.tasks_done for st in self.workers.values())
            s["url"] = self.url if self.port is not None else None
            s["pending_scale"] = self.pending_scale
            s["progress_at"] = self.progress_at
            return s

    # ---- internals -----------------------------------------------------------------------
    def _check(self, worker_id: str, generation: int, register: bool = False) -> None:
        """Refuse a call of an older launch generation or of a worker never seen (changes nothing)."""
        if generation < self.queue.generation:
            raise StaleGenerationError(
                f"worker {worker_id!r} of launch generation {generation} is stale: the master is at generation "
                f"{self.queue.generation} (its worker group was replaced); call refused")
        if not register and worker_id not in self.workers:
            raise UnknownWorkerError(
                f"unknown worker id {worker_id!r}: it never leased a task from or joined this master; call refused")

    def _admit(self, worker_id: str, generation: int) -> WorkerStats:
        """An accepted call: the worker is seen; a newer generation takes back older leases; expired ones go."""
        now = self._clock()
        stats = self.workers.get(worker_id)
        if stats is None:
            stats = self.workers[worker_id] = WorkerStats()
        stats.last_seen = now
        stats.generation = generation
        self._note(self.queue.observe_generation(generation), f"generation {generation}")
        self._note(self.queue.expire(now), "expired")
        return stats

    def _housekeeping(self, worker_id: str, generation: int, register: bool = False) -> None:
        self._check(worker_id, generation, register)
        self._admit(worker_id, generation)

    def _note(self, out: Requeued, why: str) -> None:
        if out.requeued:
            log.info("%s: %d task(s) back to TODO: %s", why, len(out.requeued), [t.task_id for t in out.requeued])
        for t in out.poisoned:
            log.warning(
                "%s: task %s (shard %d rows %d-%d) failed %d times: quarantined as poison",
                why, t.task_id, t.shard, t.row_start, t.row_end, self.queue.max_retries,
            )

    def _progress(self) -> None:
        self.progress_at = self._clock()

    def _tick(self) -> None:
        """Take back expired leases every `expiry_interval_s`; rewrite the snapshot every `snapshot_interval_s`."""
        next_snapshot = time.monotonic() + self.snapshot_interval_s
        wait = min(self.expiry_interval_s, self.snapshot_interval_s)
        while not self._stop.wait(wait):
            with self._lock:
                out = self.queue.expire(self._clock())
                if out:
                    self._note(out, "expired")
                    self._commit()
            if self._log is not None and time.monotonic() >= next_snapshot:
                next_snapshot = time.monotonic() + self.snapshot_interval_s
                try:
                    self._compact()
                except Exception:  # noqa: BLE001 - a full disk must not stop the master; the log keeps everything
                    log.exception("job master: writing the snapshot %s failed; the log keeps the changes",
                                  self.state_file)

    # ---- persistence (recforge.elastic.master.state_log) -------------------------------------------
    def _commit(self, worker_id: str | None = None, extra: Sequence[list[Any]] = ()) -> None:
        """Append what this call changed to the log as one line (under the lock, before the call answers)."""
        if self._log is None:
            self.queue.drain_changes()
            return
        changes: list[list[Any]] = []
        for kind, value in self.queue.drain_changes():
            if kind == "rec":
                self._recs[value["task"]["task_id"]] = value
            elif kind == "epoch":
                self._recs = {}  # the new epoch's records are derived (see _compact)
            changes.append([kind, value])
        changes.extend(extra)
        if worker_id is not None and worker_id in self.workers:
            changes.append(["worker", [worker_id, dict(vars(self.workers[worker_id]))]])
        if not changes:
            return
        self._changed = True
        try:
            self._log.append([dumps(changes)])
        except OSError:
            log.exception("job master: appending to the log of %s failed; the next snapshot writes everything",
                          self.state_file)
            self._log_broken = True

    def _header(self) -> dict[str, Any]:
        q = self.queue
        return {"version": 1, "shard_rows": q.shard_rows, "rows_per_task": q.rows_per_task, "epochs": q.epochs,
                "lease_timeout_s": q.lease_timeout_s, "max_retries": q.max_retries, "shuffle_seed": q.shuffle_seed,
                "epoch": q.epoch, "generation": q.generation}

    def _compact(self) -> None:
        """Fold the log into a new snapshot. Under the lock the log rotates and a child process is forked: it
        holds a copy-on-write image of the state at the rotation, serializes it and writes the snapshot, so the
        serving process spends a fork (milliseconds) instead of the JSON of the whole queue (hundreds of
        milliseconds at 25k tasks, which stalled every worker's call). Without fork: a thread, as before."""
        assert self._log is not None
        with self._lock:
            if self._log_broken:
                self._full_snapshot()
                return
            if not self._changed or not self._compactor_done():
                return
            self._changed = False
            log_from = self._log.rotate()
            if hasattr(os, "fork"):
                pid = os.fork()
                if pid == 0:  # the child: no locks, no logging, no atexit handlers
                    code = 1
                    try:
                        self._write_compacted(self._gather(), log_from)
                        code = 0
                    finally:
                        os._exit(code)
                self._compactor = pid
                return
            gathered = self._gather()
        self._write_compacted(gathered, log_from)

    def _gather(self) -> tuple[Any, ...]:
        """References to what a snapshot holds (logged records are dicts never changed afterwards)."""
        q = self.queue
        recs = list(self._recs.values())
        pristine_keys = [(r.task, r.order) for t, r in q._records.items() if t not in self._recs]
        workers = {w: dict(vars(st)) for w, st in self.workers.items()}
        scale = None if self.pending_scale is None else dict(self.pending_scale)
        return (recs, pristine_keys, self._header(), q.history, list(q._poisoned), dict(q._prev_done), workers,
                dict(self._last_lease), scale)

    def _write_compacted(self, gathered: tuple[Any, ...], log_from: int) -> None:
        assert self._log is not None
        recs, pristine_keys, header, history, poisoned, prev_done, workers, last_lease, scale = gathered
        recs.extend(_pristine(task, order) for task, order in pristine_keys)
        queue = dumps({**header, "history": history, "poisoned": [t.model_dump() for t in poisoned]})
        queue = (queue[:-1] + ',"records":[' + _chunked(recs) + '],"prev_done":{'
                 + _chunked([[k, list(v)] for k, v in prev_done.items()], pairs=True) + "}}")
        doc = dumps({"version": MASTER_STATE_VERSION, "log_from": log_from, "workers": workers,
                     "last_lease": {w: [rid, grant_json(g)] for w, (rid, g) in last_lease.items()},
                     "pending_scale": scale})
        self._log.write_snapshot(doc[:-1] + ',"queue":' + queue + "}", log_from)

    def _compactor_done(self, wait_s: float = 0.0) -> bool:
        """Whether no compaction child runs (reaping it when it has exited); waits up to `wait_s`, then kills it
        (its snapshot is not needed: the segments it would have folded are still there)."""
        if self._compactor is None:
            return True
        deadline = time.monotonic() + wait_s
        while True:
            pid, status = os.waitpid(self._compactor, os.WNOHANG)
            if pid != 0:
                if os.waitstatus_to_exitcode(status) != 0:
                    log.warning("job master: the snapshot child exited with %d; the log keeps the changes",
                                os.waitstatus_to_exitcode(status))
                    self._changed = True
                self._compactor = None
                return True
            if time.monotonic() >= deadline:
                if wait_s > 0:
                    log.warning("job master: the snapshot child did not finish in %.0f s; killed", wait_s)
                    os.kill(self._compactor, signal.SIGKILL)
                    os.waitpid(self._compactor, 0)
                    self._compactor = None
                    return True
                return False
            time.sleep(0.01)

    def _full_snapshot(self) -> None:
        """The whole state from memory into a new snapshot, the log restarted after it (start, stop, after a
        failed append). Called under the lock."""
        assert self._log is not None and self.state_file is not None
        self._compactor_done(wait_s=COMPACTOR_WAIT_S)  # a late child must not replace this snapshot
        self.queue.drain_changes()
        qd = self.queue.to_dict()
        self._recs = {r["task"]["task_id"]: r for r in qd["records"]}
        segs = self._log.segments()
        log_from = max([self._log.segment or 0, *(n for n, _ in segs)]) + 1
        doc = {"version": MASTER_STATE_VERSION, "log_from": log_from, "queue": qd,
               "workers": {w: asdict(st) for w, st in self.workers.items()},
               "last_lease": {w: [rid, grant_json(g)] for w, (rid, g) in self._last_lease.items()},
               "pending_scale": self.pending_scale}
        self._log.open(log_from)
        self._log.write_snapshot(dumps(doc), log_from)
        self._log_broken = False
        self._changed = False

    def _restore(self, fresh: TaskQueue, new_launch: bool) -> TaskQueue:
        assert self._log is not None
        saved = self._log.load()
        if saved.torn:
            log.warning("job master state: %s", saved.torn)
        queue = self._checked_queue(saved.queue, fresh, str(self.state_file))
        # Tunables follow the new configuration.
        queue.lease_timeout_s = fresh.lease_timeout_s
        queue.max_retries = fresh.max_retries
        if not new_launch:  # renewals are not logged; the holders could not reach a dead master anyway
            queue.grace(self._clock())
        self.workers = {w: WorkerStats(**st) for w, st in saved.workers.items()}
        self._last_lease = {w: (rid, Grant.model_validate(g)) for w, (rid, g) in saved.last_lease.items()}
        self.pending_scale = saved.pending_scale
        log.info("job master resumed from %s at epoch %d (%d log line(s) replayed)", self.state_file, queue.epoch,
                 saved.lines)
        return queue

    @staticmethod
    def _checked_queue(queue: TaskQueue, fresh: TaskQueue, where: str) -> TaskQueue:
        for name in ("shard_rows", "rows_per_task", "epochs"):
            if getattr(queue, name) != getattr(fresh, name):
                raise ValueError(
                    f"{where}: saved {name}={getattr(queue, name)!r} does not match this job's "
                    f"{name}={getattr(fresh, name)!r}; use a new state file for a different job"
                )
        return queue

    # ---- HTTP ----------------------------------------------------------------------------
    def _build_app(self) -> _Api:
        def lease(req: LeaseRequest) -> dict[str, Any]:
            g = self.lease(req.worker_id, req.epoch, req.generation, req.request_id)
            return {**grant_json(g), "finished": g.action is Action.FINISHED}

        def done(req: DoneRequest) -> dict[str, Any]:
            out = self.done(req.worker_id, req.task_id, req.samples, req.generation)
            return {"accepted": out.ok, "status": out.value}

        def release(req: ReleaseRequest) -> dict[str, Any]:
            out = self.release(req.worker_id, req.task_id, req.rows_consumed, req.generation)
            return {"accepted": out.ok, "status": out.value}

        def heartbeat(req: HeartbeatRequest) -> dict[str, Any]:
            renewed, lost = self.heartbeat_leases(req.worker_id, req.step, req.generation, req.held)
            return {"renewed": renewed, "lost": lost}

        def snapshot(req: SnapshotRequest) -> dict[str, Any]:
            return _rejecting(lambda: self.snapshot(req.worker_id, req.generation, req.progress), "", (ValueError,))

        def restore(req: RestoreRequest) -> dict[str, Any]:
            return _rejecting(lambda: self.restore(req.worker_id, req.generation, req.state, req.reason),
                              "restore: bad data state: ", (ValueError, KeyError, TypeError))

        def recover(req: RecoverRequest) -> dict[str, Any]:
            out = self.recover(req.worker_id)
            return {"requeued": [t.task_id for t in out.requeued], "poisoned": [t.task_id for t in out.poisoned]}

        return _Api({
            ("POST", "/lease"): (LeaseRequest, lease),
            ("POST", "/done"): (DoneRequest, done),
            ("POST", "/release"): (ReleaseRequest, release),
            ("POST", "/heartbeat"): (HeartbeatRequest, heartbeat),
            ("POST", "/join"): (WorkerCall, lambda req: self.join(req.worker_id, req.generation)),
            ("POST", "/snapshot"): (SnapshotRequest, snapshot),
            ("POST", "/restore"): (RestoreRequest, restore),
            ("POST", "/scale"): (ScaleRequest, lambda req: self.request_scale(req.workers, req.reason)),
            ("POST", "/command"): (WorkerCall, lambda req: self.command(req.worker_id, req.generation)),
            ("POST", "/recover"): (RecoverRequest, recover),
            ("GET", "/state"): (None, lambda req: self.state()),
        }, token=self._token, max_body_bytes=self.max_body_bytes)


def grant_json(g: Grant) -> dict[str, Any]:
    """A lease answer as JSON (Grant.model_dump(mode="json"), without pydantic on the hot path)."""
    t = g.task
    task = None if t is None else {"task_id": t.task_id, "epoch": t.epoch, "shard": t.shard,
                                   "row_start": t.row_start, "row_end": t.row_end}
    return {"action": g.action.value, "task": task, "epoch": g.epoch, "epochs": g.epochs}


def tune_gc_for_serving() -> None:
    """For a process whose main job is serving the master: move what exists now out of the collector's view
    and collect the youngest generation less often. A full collection over the queue's records took ~100 ms
    at 25k tasks and stalled every call in flight (bench_master: lease p99 368 -> 62 ms at 1,024 workers)."""
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def _rejecting(call: Callable[[], Any], prefix: str, errors: tuple[type[Exception], ...]) -> Any:
    """Run an endpoint's operation; bad input it raises (`errors`) becomes a MasterRejection (HTTP 400)."""
    try:
        return call()
    except MasterRejection:
        raise
    except errors as e:
        raise MasterRejection(f"{prefix}{e}") from e


def _chunked(items: list[Any], pairs: bool = False, chunk: int = 500) -> str:
    """JSON of a list's items (of a dict's [key, value] pairs with `pairs`) without the brackets, serialized a
    chunk at a time: one json.dumps of a large state holds the GIL for tens of milliseconds, which would stall
    the event loop serving the workers; between chunks the compactor yields it."""
    parts = []
    for i in range(0, len(items), chunk):
        part = items[i:i + chunk]
        text = dumps(dict(part) if pairs else part)[1:-1]
        if text:
            parts.append(text)
        time.sleep(0)  # let the event loop run
    return ",".join(parts)


def _pristine(task: Task, order: int) -> dict[str, Any]:
    """The record of a task not touched since its epoch started (TaskQueue._start_epoch)."""
    return {"task": {"task_id": task.task_id, "epoch": task.epoch, "shard": task.shard,
                     "row_start": task.row_start, "row_end": task.row_end},
            "order": order, "state": "todo", "worker_id": None, "deadline": None, "generation": 0, "retries": 0}


def _peer(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


_Receive = Callable[[], Awaitable[dict[str, Any]]]
_Send = Callable[[dict[str, Any]], Awaitable[None]]
_Route = tuple[type[BaseModel] | None, Callable[[Any], dict[str, Any]]]


class _Api:
    """The master's ASGI app. In order: the bearer token (401), the body size (413, refused before the body is
    read further or parsed), the route (404 / 405), the strictly typed body (422), the operation (its
    MasterRejection: 400 / 404 / 409 / 422). Every refusal is logged (never with the token) and changes nothing.
    A plain ASGI callable, no framework routing or middleware: the handlers run on the event loop (no thread hop);
    the operations are short and take the master's lock."""

    def __init__(self, routes: dict[tuple[str, str], _Route], *, token: str, max_body_bytes: int) -> None:
        self.routes = routes
        self.paths = {path for _, path in routes}
        self._expected = f"Bearer {token}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            return
        auth = length = None
        for key, value in scope["headers"]:
            if key == b"authorization":
                auth = value
            elif key == b"content-length":
                length = value
        if auth is None or not hmac.compare_digest(auth, self._expected):
            why = "no Authorization header" if auth is None else "wrong token"
            await _refuse(scope, send, 401, f"missing or wrong bearer token ({why})", "Unauthorized",
                          [(b"www-authenticate", b"Bearer")])
            return
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                await _refuse(scope, send, 400, "Content-Length is not a number", "BadRequest")
                return
            if n > self.max_body_bytes:
                await _refuse(scope, send, 413, f"request body of {n} bytes is above the limit of "
                              f"{self.max_body_bytes} bytes", "PayloadTooLarge")
                return
        route = self.routes.get((scope["method"], scope["path"]))
        if route is None:
            status = 405 if scope["path"] in self.paths else 404
            await _refuse(scope, send, status, f"no endpoint {scope['method']} {scope['path']}",
                          "MethodNotAllowed" if status == 405 else "NotFound")
            return
        chunks, size, more = [], 0, True
        while more:  # without Content-Length (chunked) the limit is checked while the body streams in
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _refuse(scope, send, 413, f"request body above the limit of {self.max_body_bytes} bytes",
                              "PayloadTooLarge")
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        model, op = route
        req = None
        if model is not None:
            try:
                req = model.model_validate_json(b"".join(chunks) or b"null")
            except ValidationError as e:
                errors = [{"loc": list(x["loc"]), "msg": x["msg"], "type": x["type"]}  # the input is not echoed
                          for x in e.errors(include_url=False, include_context=False, include_input=False)]
                why = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in errors)
                await _refuse(scope, send, 422, why, "ValidationError", detail=errors)
                return
        try:
            result = op(req)
        except MasterRejection as e:
            await _refuse(scope, send, e.http_status, str(e), type(e).__name__)
            return
        except Exception:
            log.exception("job master: %s %s failed", scope["method"], scope["path"])
            await _respond(send, 500, {"detail": "internal error (see the master's log)", "error": "InternalError"})
            return
        await _respond(send, 200, result)


async def _respond(send: _Send, status: int, doc: Any, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    payload = dumps(doc).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


async def _refuse(scope: dict[str, Any], send: _Send, status: int, why: str, error: str,
                  headers: Sequence[tuple[bytes, bytes]] = (), detail: Any = None) -> None:
    log.warning("job master: %s %s from %s refused (%d): %s", scope.get("method"), scope.get("path"),
                _peer(scope), status, why[:500])
    await _respond(send, status, {"detail": why if detail is None else detail, "error": error}, headers)
