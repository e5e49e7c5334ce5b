"""The job master: one HTTP service per training job handing out data-shard tasks.

A FastAPI app served by uvicorn in a background thread on 127.0.0.1 (a free port unless one is
given). Every call first takes back expired leases (and a periodic thread does the same), then acts
on the `TaskQueue` under one lock. After every change the queue and the per-worker statistics are
written atomically (temp file + os.replace) to `state_file`; a master started on an existing state
file resumes from it (same shards, task size and epochs, or it refuses).

Endpoints (JSON bodies; `generation` is the worker's launch generation, see TaskQueue.observe_generation):
  POST /lease      {worker_id, epoch?, generation, request_id?} -> {action, task?, epoch, epochs, finished}
  POST /done       {worker_id, task_id, samples, generation}   -> {accepted, status}
  POST /release    {worker_id, task_id, rows_consumed, generation} -> {accepted, status}
  POST /heartbeat  {worker_id, step, generation}                -> {renewed}
  POST /recover    {worker_id?}                                  -> {requeued, poisoned}
  GET  /state      -> queue summary + workers
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from fastapi import FastAPI
from pydantic import BaseModel, Field

from recforge.elastic.tasks import Action, Grant, Outcome, Requeued, TaskQueue

log = logging.getLogger(__name__)

MASTER_STATE_VERSION = 1


def shard_rows_from_manifest(manifest_dir: str | Path) -> list[int]:
    """Row counts of a data manifest's shards (`manifest.json`: shards[*].rows), read as plain JSON."""
    path = Path(manifest_dir) / "manifest.json"
    if not path.exists():
        raise FileNotFoundError(f"manifest not found: {path}")
    data = json.loads(path.read_text())
    try:
        rows = [int(s["rows"]) for s in data["shards"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: expected shards[*].rows integers ({e!r})") from e
    return rows


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


class LeaseRequest(BaseModel):
    worker_id: str = Field(min_length=1)
    epoch: int | None = None
    generation: int = Field(0, ge=0)
    request_id: str | None = None


class DoneRequest(BaseModel):
    worker_id: str = Field(min_length=1)
    task_id: str
    samples: int = Field(ge=0)
    generation: int = Field(0, ge=0)


class ReleaseRequest(BaseModel):
    worker_id: str = Field(min_length=1)
    task_id: str
    rows_consumed: int = Field(ge=0)
    generation: int = Field(0, ge=0)


class HeartbeatRequest(BaseModel):
    worker_id: str = Field(min_length=1)
    step: int = Field(ge=0)
    generation: int = Field(0, ge=0)


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
    ) -> None:
        """`new_launch=True`: leases restored from `state_file` belong to workers that are gone
        (the caller is about to launch new ones), so they go back to TODO at once."""
        self._lock = threading.Lock()
        self._clock = clock
        self.host = host
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
        self._server = None
        self._thread: threading.Thread | None = None
        self._ticker: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self.port: int | None = None
        self.app = self._build_app()

    @classmethod
    def from_manifest(cls, manifest_dir: str | Path, **kwargs: Any) -> "JobMaster":
        return cls(shard_rows_from_manifest(manifest_dir), **kwargs)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("JobMaster.url: the master is not started")
        return f"http://{self.host}:{self.port}"

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self, timeout_s: float = 15.0) -> "JobMaster":
        import uvicorn

        if self._thread is not None:
            raise RuntimeError("JobMaster.start: already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._requested_port))
        self.port = sock.getsockname()[1]
        self._sock = sock  # owned by uvicorn's asyncio server while it runs; closed again in stop()
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="recforge-job-master", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
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

    def __enter__(self) -> "JobMaster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- operations (the endpoints call these; usable in-process too) ------------------------
    def lease(self, worker_id: str, epoch: int | None = None, generation: int = 0, request_id: str | None = None) -> Grant:
        with self._lock:
            self._housekeeping(worker_id, generation)
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
        with self._lock:
            self._housekeeping(worker_id, generation)
            out = self.queue.done(task_id, worker_id)
            stats = self.workers[worker_id]
            if out is Outcome.ACCEPTED:
                stats.tasks_done += 1
                stats.samples += samples
            elif not out.ok:
                stats.rejected += 1
                log.warning("done(%s) from %s rejected: %s", task_id, worker_id, out.value)
            self._persist()
            return out

    def release(self, worker_id: str, task_id: str, rows_consumed: int, generation: int = 0) -> Outcome:
        with self._lock:
            self._housekeeping(worker_id, generation)
            out = self.queue.release(task_id, worker_id, rows_consumed)
            stats = self.workers[worker_id]
            if out is Outcome.ACCEPTED:
                stats.releases += 1
                stats.samples += rows_consumed
            elif not out.ok:
                stats.rejected += 1
                log.warning("release(%s) from %s rejected: %s", task_id, worker_id, out.value)
            self._persist()
            return out

    def heartbeat(self, worker_id: str, step: int, generation: int = 0) -> int:
        with self._lock:
            self._housekeeping(worker_id, generation)
            self.workers[worker_id].step = step
            renewed = self.queue.renew(worker_id, self._clock())
            self._persist()
            return renewed

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
            return s

    # ---- internals -----------------------------------------------------------------------
    def _housekeeping(self, worker_id: str, generation: int) -> None:
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
        queue = TaskQueue.from_dict(doc["queue"])
        for name in ("shard_rows", "rows_per_task", "epochs"):
            if getattr(queue, name) != getattr(fresh, name):
                raise ValueError(
                    f"{self.state_file}: saved {name}={getattr(queue, name)!r} does not match this job's "
                    f"{name}={getattr(fresh, name)!r}; use a new state file for a different job"
                )
        # Tunables follow the new configuration.
        queue.lease_timeout_s = fresh.lease_timeout_s
        queue.max_retries = fresh.max_retries
        self.workers = {w: WorkerStats(**st) for w, st in doc["workers"].items()}
        log.info("job master resumed from %s at epoch %d", self.state_file, queue.epoch)
        return queue

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="recforge job master")

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
            return {"renewed": self.heartbeat(req.worker_id, req.step, req.generation)}

        @app.post("/recover")
        def _recover(req: RecoverRequest) -> dict[str, Any]:
            out = self.recover(req.worker_id)
            return {"requeued": [t.task_id for t in out.requeued], "poisoned": [t.task_id for t in out.poisoned]}

        @app.get("/state")
        def _state() -> dict[str, Any]:
            return self.state()

        return app
