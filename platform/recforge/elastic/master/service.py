"""The job master: one HTTP service per training job handing out data-shard tasks (recforge.elastic.master.tasks).

Endpoints (JSON bodies; `generation` is the caller's launch generation; a refused call changes nothing and answers
404 for an unknown worker, 409 for an older generation, 422 for a scale outside [1, max_workers]):
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
Persistence, lease expiry, epochs and generations: docs/fault_tolerance.md#data-shard-tasks.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from recforge.data.manifest import shard_rows_from_manifest
from recforge.elastic.master.tasks import Action, Grant, Outcome, Requeued, TaskQueue

log = logging.getLogger(__name__)

MASTER_STATE_VERSION = 1


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


class WorkerCall(BaseModel):
    """Who calls: every worker call names its id and its launch generation (POST /join, /command)."""

    worker_id: str = Field(min_length=1)
    generation: int = Field(0, ge=0)


class LeaseRequest(WorkerCall):
    epoch: int | None = None
    request_id: str | None = None


class DoneRequest(WorkerCall):
    task_id: str
    samples: int = Field(ge=0)


class ReleaseRequest(WorkerCall):
    task_id: str
    rows_consumed: int = Field(ge=0)


class HeartbeatRequest(WorkerCall):
    step: int = Field(ge=0)
    held: list[str] | None = None


class SnapshotRequest(WorkerCall):
    progress: dict[str, int] = Field(default_factory=dict)


class RestoreRequest(WorkerCall):
    state: dict[str, Any] | None = None
    reason: str = ""


class ScaleRequest(BaseModel):
    workers: int
    reason: str = ""


class RecoverRequest(BaseModel):
    worker_id: str | None = None


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
    ) -> None:
        """`new_launch=True`: leases restored from `state_file` belong to workers that are gone
        (the caller is about to launch new ones), so they go back to TODO at once.
        `max_workers`: the largest world size a scale request may ask for (None: no upper limit).
        `advertise_host`: the address workers use in `url` when it differs from the bind `host` (0.0.0.0)."""
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
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
        self.state_file = Path(state_file) if state_file is not None else None
        self.workers: dict[str, WorkerStats] = {}
        self._last_lease: dict[str, tuple[str, Grant]] = {}
        fresh = TaskQueue(
            shard_rows, rows_per_task, epochs,
            lease_timeout_s=lease_timeout_s, max_retries=max_retries, shuffle_seed=shuffle_seed,
        )
        self.restored = self.state_file is not None and self.state_file.exists()
        self.queue = self._restore(fresh) if self.restored else fresh
        if new_launch:
            self._note(self.queue.new_launch(), "new launch")
        self._persist()
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
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="recforge-job-master", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"JobMaster: server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self._stop.clear()
        self._ticker = threading.Thread(target=self._tick, name="recforge-job-master-expiry", daemon=True)
        self._ticker.start()
        log.info("job master listening on %s (state file %s)", self.url, self.state_file)
        return self

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
        with self._lock:
            self._persist()

    def __enter__(self) -> JobMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- operations (the endpoints call these; usable in-process too) ------------------------
    def lease(self, worker_id: str, epoch: int | None = None, generation: int = 0,
              request_id: str | None = None) -> Grant:
        with self._lock:
            self._housekeeping(worker_id, generation, register=True)
            if request_id is not None:
                last = self._last_lease.get(worker_id)
                if last is not None and last[0] == request_id:
                    return last[1]  # a retried request whose answer was lost: same answer
            grant = self.queue.request(worker_id, self._clock(), epoch, generation)
            if request_id is not None:
                self._last_lease[worker_id] = (request_id, grant)
            if grant.action is Action.TASK:
                self.workers[worker_id].leases += 1
            self._persist()
            return grant

    def done(self, worker_id: str, task_id: str, samples: int, generation: int = 0) -> Outcome:
        return self._report("done", worker_id, generation, task_id, samples)

    def release(self, worker_id: str, task_id: str, rows_consumed: int, generation: int = 0) -> Outcome:
        return self._report("release", worker_id, generation, task_id, rows_consumed)

    def _report(self, kind: str, worker_id: str, generation: int, task_id: str, rows: int) -> Outcome:
        """A task finished (`done`, its `rows` trained) or handed back with `rows` of it trained (`release`)."""
        with self._lock:
            self._housekeeping(worker_id, generation)
            out = (self.queue.done(task_id, worker_id) if kind == "done"
                   else self.queue.release(task_id, worker_id, rows))
            stats = self.workers[worker_id]
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
            self._persist()
            return out

    def heartbeat(self, worker_id: str, step: int, generation: int = 0) -> int:
        return self.heartbeat_leases(worker_id, step, generation)[0]

    def heartbeat_leases(
        self, worker_id: str, step: int, generation: int = 0, held: Sequence[str] | None = None
    ) -> tuple[int, list[str]]:
        """Renew the worker's leases: (how many were renewed, which of `held` it no longer holds)."""
        with self._lock:
            self._housekeeping(worker_id, generation)
            stats = self.workers[worker_id]
            if stats.step is None or step > stats.step:
                self._progress()
            stats.step = step
            renewed = self.queue.renew(worker_id, self._clock())
            holding = set(self.queue.held_by(worker_id))
            lost = sorted(t for t in (held or ()) if t not in holding)
            if lost:
                log.warning("heartbeat from %s: leases %s expired or were taken back; not renewed", worker_id, lost)
            self._persist()
            return renewed, lost

    def join(self, worker_id: str, generation: int = 0) -> dict[str, Any]:
        """A worker of launch generation `generation` starts: register it (its calls are accepted from now)."""
        with self._lock:
            self._housekeeping(worker_id, generation, register=True)
            self._progress()
            self._persist()
            return self.queue.summary()

    def snapshot(self, worker_id: str, generation: int, progress: dict[str, int]) -> dict[str, Any]:
        """The data state for a checkpoint taken now (`TaskQueue.snapshot`); changes nothing."""
        with self._lock:
            self._housekeeping(worker_id, generation)
            return self.queue.snapshot(progress)

    def restore(self, worker_id: str, generation: int, state: dict[str, Any] | None,
                reason: str = "") -> dict[str, Any]:
        """Roll the queue back to a checkpoint's data state (None: to the very start: the model starts
        from its initial weights, so no row counts as trained). Called by rank 0 of a (re)started group
        before any rank leases; older generations are locked out from now on."""
        with self._lock:
            self._housekeeping(worker_id, generation, register=True)
            before = self.queue.summary()
            fresh = self.queue.restarted()
            queue = fresh if state is None else self._checked_queue(TaskQueue.from_dict(state), fresh, "restore")
            queue.lease_timeout_s, queue.max_retries = fresh.lease_timeout_s, fresh.max_retries
            queue.recover(None)  # a checkpoint's state has no lease in flight (TaskQueue.snapshot); be safe anyway
            queue.generation = max(self.queue.generation, generation)
            self.queue = queue
            self._last_lease.clear()
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
            self._persist()
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
            self._persist()
            return dict(self.pending_scale)

    def take_scale(self) -> dict[str, Any] | None:
        """The pending scale request, cleared (the supervisor calls this when it relaunches)."""
        with self._lock:
            req, self.pending_scale = self.pending_scale, None
            self._persist()
            return req

    def command(self, worker_id: str, generation: int = 0) -> dict[str, str]:
        """What the group should do at its next checkpoint boundary."""
        with self._lock:
            self._housekeeping(worker_id, generation)
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
            self._persist()
            return out

    def state(self) -> dict[str, Any]:
        with self._lock:
            self._note(self.queue.expire(self._clock()), "expired")
            s = self.queue.summary()
            s["workers"] = {w: asdict(st) for w, st in sorted(self.workers.items())}
            s["samples"] = sum(st.samples for st in self.workers.values())
            s["tasks_done"] = sum(st.tasks_done for st in self.workers.values())
            s["url"] = self.url if self.port is not None else None
            s["pending_scale"] = self.pending_scale
            s["progress_at"] = self.progress_at
            return s

    # ---- internals -----------------------------------------------------------------------
    def _housekeeping(self, worker_id: str, generation: int, register: bool = False) -> None:
        if generation < self.queue.generation:
            raise StaleGenerationError(
                f"worker {worker_id!r} of launch generation {generation} is stale: the master is at generation "
                f"{self.queue.generation} (its worker group was replaced); call refused")
        if not register and worker_id not in self.workers:
            raise UnknownWorkerError(
                f"unknown worker id {worker_id!r}: it never leased a task from or joined this master; call refused")
        now = self._clock()
        stats = self.workers.setdefault(worker_id, WorkerStats())
        stats.last_seen = now
        stats.generation = generation
        self._note(self.queue.observe_generation(generation), f"generation {generation}")
        self._note(self.queue.expire(now), "expired")

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
        while not self._stop.wait(self.expiry_interval_s):
            with self._lock:
                out = self.queue.expire(self._clock())
                if out:
                    self._note(out, "expired")
                    self._persist()

    def _persist(self) -> None:
        if self.state_file is None:
            return
        doc = {
            "version": MASTER_STATE_VERSION,
            "queue": self.queue.to_dict(),
            "workers": {w: asdict(st) for w, st in self.workers.items()},
            "last_lease": {w: [rid, g.model_dump(mode="json")] for w, (rid, g) in self._last_lease.items()},
            "pending_scale": self.pending_scale,
        }
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state_file)

    def _restore(self, fresh: TaskQueue) -> TaskQueue:
        assert self.state_file is not None
        doc = json.loads(self.state_file.read_text())
        if doc.get("version") != MASTER_STATE_VERSION:
            raise ValueError(f"{self.state_file}: unsupported master state version {doc.get('version')!r}")
        queue = self._checked_queue(TaskQueue.from_dict(doc["queue"]), fresh, str(self.state_file))
        # Tunables follow the new configuration.
        queue.lease_timeout_s = fresh.lease_timeout_s
        queue.max_retries = fresh.max_retries
        self.workers = {w: WorkerStats(**st) for w, st in doc["workers"].items()}
        self._last_lease = {w: (rid, Grant.model_validate(g)) for w, (rid, g) in doc.get("last_lease", {}).items()}
        self.pending_scale = doc.get("pending_scale")
        log.info("job master resumed from %s at epoch %d", self.state_file, queue.epoch)
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

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="recforge job master")

        @app.exception_handler(MasterRejection)
        def _rejected(request: Request, exc: MasterRejection) -> JSONResponse:
            return JSONResponse(status_code=exc.http_status, content={"detail": str(exc), "error": type(exc).__name__})

        @app.post("/lease")
        def _lease(req: LeaseRequest) -> dict[str, Any]:
            g = self.lease(req.worker_id, req.epoch, req.generation, req.request_id)
            return {**g.model_dump(mode="json"), "finished": g.action is Action.FINISHED}

        @app.post("/done")
        def _done(req: DoneRequest) -> dict[str, Any]:
            out = self.done(req.worker_id, req.task_id, req.samples, req.generation)
            return {"accepted": out.ok, "status": out.value}

        @app.post("/release")
        def _release(req: ReleaseRequest) -> dict[str, Any]:
            out = self.release(req.worker_id, req.task_id, req.rows_consumed, req.generation)
            return {"accepted": out.ok, "status": out.value}

        @app.post("/heartbeat")
        def _heartbeat(req: HeartbeatRequest) -> dict[str, Any]:
            renewed, lost = self.heartbeat_leases(req.worker_id, req.step, req.generation, req.held)
            return {"renewed": renewed, "lost": lost}

        @app.post("/join")
        def _join(req: WorkerCall) -> dict[str, Any]:
            return self.join(req.worker_id, req.generation)

        @app.post("/snapshot")
        def _snapshot(req: SnapshotRequest) -> dict[str, Any]:
            return _rejecting(lambda: self.snapshot(req.worker_id, req.generation, req.progress), "", (ValueError,))

        @app.post("/restore")
        def _restore(req: RestoreRequest) -> dict[str, Any]:
            return _rejecting(lambda: self.restore(req.worker_id, req.generation, req.state, req.reason),
                              "restore: bad data state: ", (ValueError, KeyError, TypeError))

        @app.post("/scale")
        def _scale(req: ScaleRequest) -> dict[str, Any]:
            return self.request_scale(req.workers, req.reason)

        @app.post("/command")
        def _command(req: WorkerCall) -> dict[str, Any]:
            return self.command(req.worker_id, req.generation)

        @app.post("/recover")
        def _recover(req: RecoverRequest) -> dict[str, Any]:
            out = self.recover(req.worker_id)
            return {"requeued": [t.task_id for t in out.requeued], "poisoned": [t.task_id for t in out.poisoned]}

        @app.get("/state")
        def _state() -> dict[str, Any]:
            return self.state()

        return app


def _rejecting(call: Callable[[], Any], prefix: str, errors: tuple[type[Exception], ...]) -> Any:
    """Run an endpoint's operation; bad input it raises (`errors`) becomes a MasterRejection (HTTP 400)."""
    try:
        return call()
    except MasterRejection:
        raise
    except errors as e:
        raise MasterRejection(f"{prefix}{e}") from e
