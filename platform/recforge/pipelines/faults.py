"""Fault injection from outside a training job, for `recforge bench faults` and the fault tests.

Real faults against real processes and files: a signal to a worker found through the job master's state file,
the job master as its own process (kill, restart on the same port), a checkpoint file overwritten with random
bytes or one tensor's bytes with NaN, a checkpoint directory on a small tmpfs (full), an MLflow tracking server
stopped and started again. What each fault is expected to do is in docs/fault_tolerance.md (fault matrix).
In-process faults (a worker raising, OOM, a hang at a given step) are recforge.train.recovery.faults.
"""
from __future__ import annotations

import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recforge.elastic.master.state_log import read_master_state
from recforge.train.recovery.layout import CHECKSUMS_FILE, step_dirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Any, timeout_s: float, interval_s: float = 0.05) -> Any:
    """Poll `check()` until it returns something truthy; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


# ---- workers, found through the master's state file ----------------------------------------------------------
def read_state(state_file: Path) -> dict[str, Any] | None:
    """The master's persisted state (snapshot + log, as the master would resume it); None while there is none."""
    if not Path(state_file).exists():
        return None
    try:
        return read_master_state(state_file)
    except (OSError, ValueError, KeyError):  # being written: the caller polls again
        return None


def tasks_done(state: dict[str, Any]) -> int:
    return sum(1 for r in state["queue"]["records"] if r["state"] == "done")


def worker_pid(state_file: Path, rank: int, min_done: int = 0, min_generation: int = 0) -> int | None:
    """The pid of rank `rank`'s newest worker of generation >= `min_generation` once the master counts
    `min_done` tasks done; None before. Worker ids are `rank<r>-<pid>-...` (worker/elastic_client.py)."""
    state = read_state(state_file)
    if state is None or tasks_done(state) < min_done:
        return None
    ids = [w for w, s in state["workers"].items()
           if w.startswith(f"rank{rank}-") and int(s.get("generation", 0)) >= min_generation]
    return int(ids[-1].split("-")[1]) if ids else None


@dataclass
class SignalAt:
    """A thread that sends `sig` to rank `rank`'s worker once the master has `min_done` tasks done (and the
    worker is of generation >= `min_generation`). `pid` / `at` (wall time) are set when it fired; `error` when it
    gave up after `timeout_s`."""

    state_file: Path
    sig: int = signal.SIGKILL
    rank: int = 1
    min_done: int = 1
    min_generation: int = 0
    timeout_s: float = 300.0
    pid: int | None = None
    at: float | None = None
    error: str | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> SignalAt:
        self._thread = threading.Thread(target=self._run, name="fault-signal", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            pid = worker_pid(self.state_file, self.rank, self.min_done, self.min_generation)
            if pid is not None:
                try:
                    os.kill(pid, self.sig)
                except ProcessLookupError:  # that worker is gone already: wait for the next one
                    time.sleep(0.05)
                    continue
                self.pid, self.at = pid, time.time()
                return
            time.sleep(0.05)
        self.error = (f"rank {self.rank} (generation >= {self.min_generation}) never reached {self.min_done} "
                      f"task(s) done within {self.timeout_s:.0f}s")

    def join(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)


# ---- the job master as its own process ---------------------------------------------------------------------
class MasterProcess:
    """`python -m recforge.elastic.master.main` on a fixed port, killed and restarted from its state file. Its
    bearer token is in `token_file` (created by the first start; workers get it as the spec's master_token_file)."""

    def __init__(self, manifest_dir: Path, rows_per_task: int, state_file: Path, log_dir: Path, *,
                 port: int | None = None, lease_timeout_s: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.manifest_dir, self.rows_per_task, self.state_file = Path(manifest_dir), rows_per_task, Path(state_file)
        self.log_dir, self.port, self.lease_timeout_s = Path(log_dir), port or free_port(), lease_timeout_s
        self.token_file = self.log_dir / "master.token"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.url: str | None = None

    def start(self, timeout_s: float = 60.0) -> str:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        url_file = self.log_dir / f"master-{self.starts}.url"
        url_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "recforge.elastic.master.main", "--manifest", str(self.manifest_dir),
               "--rows-per-task", str(self.rows_per_task), "--state-file", str(self.state_file),
               "--port", str(self.port), "--lease-timeout-s", str(self.lease_timeout_s), "--url-file", str(url_file),
               "--token-file", str(self.token_file)]
        with open(self.log_dir / f"master-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.starts += 1
        proc = self.proc

        def listening() -> str | None:
            if proc.poll() is not None:
                raise RuntimeError(f"job master exited with {proc.returncode} before listening; see "
                                   f"{self.log_dir / f'master-{self.starts - 1}.log'}")
            return url_file.read_text() if url_file.exists() and url_file.read_text() else None

        self.url = wait_for(f"the job master to write {url_file}", listening, timeout_s)
        return str(self.url)

    def client(self, worker_id: str = "observer") -> Any:
        from recforge.elastic.agent.client import MasterClient, read_token_file  # lazy: only when a test observes

        if self.url is None:
            raise RuntimeError("the job master was never started")
        return MasterClient(self.url, worker_id, token=read_token_file(self.token_file))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def log_text(self, start: int) -> str:
        path = self.log_dir / f"master-{start}.log"
        return path.read_text(errors="replace") if path.exists() else ""


# ---- checkpoints -------------------------------------------------------------------------------------------
def newest_checkpoint(root: Path) -> Path:
    """The newest complete disk step checkpoint under `root` (has CHECKSUMS.json)."""
    done = [p for _, p in step_dirs(root) if (p / CHECKSUMS_FILE).exists()]
    if not done:
        raise FileNotFoundError(f"no complete step checkpoint under {root}")
    return done[-1]


def corrupt_random(path: Path, nbytes: int = 64, seed: int = 0) -> tuple[int, int]:
    """Overwrite `nbytes` bytes in the middle of `path` with random ones (size kept); (offset, length)."""
    path = Path(path)
    raw = bytearray(path.read_bytes())
    n = min(nbytes, len(raw))
    offset = max((len(raw) - n) // 2, 0)
    rng = np.random.default_rng(seed)
    new = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if new == bytes(raw[offset:offset + n]):  # astronomically unlikely; never leave the file unchanged
        new = bytes(b ^ 0xFF for b in new)
    raw[offset:offset + n] = new
    path.write_bytes(bytes(raw))
    return offset, n


@dataclass(frozen=True)
class NanRegion:
    file: Path
    key: str  # the state-dict key whose bytes were overwritten
    offset: int
    length: int


def corrupt_nan_region(ckpt_dir: Path, max_bytes: int = 4096) -> NanRegion:
    """Overwrite bytes in the middle of the largest float32 tensor stored in a DCP checkpoint with float32 NaNs
    (at most `max_bytes`, file size kept): a silent corruption that still parses, which only the checksums catch."""
    import torch  # lazy: torch only where a checkpoint is damaged
    from torch.distributed.checkpoint import FileSystemReader  # lazy: as above
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # lazy: as above

    ckpt_dir = Path(ckpt_dir)
    meta = FileSystemReader(str(ckpt_dir)).read_metadata()
    regions = []
    for index, info in (meta.storage_data or {}).items():
        md = meta.state_dict_metadata.get(index.fqn)
        if isinstance(md, TensorStorageMetadata) and md.properties.dtype == torch.float32:
            regions.append((int(info.length), index.fqn, info))
    if not regions:
        raise ValueError(f"no float32 tensor region in the DCP metadata of {ckpt_dir}")
    size, key, info = max(regions, key=lambda r: r[0])
    length = min(size // 2, max_bytes) // 4 * 4  # the middle of the record: tensor data, not its zip header
    offset = (int(info.offset) + size // 2 - length // 2) // 4 * 4
    path = ckpt_dir / info.relative_path
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<f", math.nan) * (length // 4))
    return NanRegion(path, key, offset, length)


# ---- a full checkpoint directory ---------------------------------------------------------------------------
class SpaceLimitUnavailable(RuntimeError):
    """A size-limited directory cannot be made here (mounting a tmpfs is not permitted)."""


@contextmanager
def small_filesystem(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` mounted at `path` (root, or where mounting is allowed): writes beyond it fail
    with ENOSPC like a full disk. Unmounted on exit. SpaceLimitUnavailable when mounting is refused."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={int(size_bytes)},mode=0700", "tmpfs", str(path)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as e:
        raise SpaceLimitUnavailable(f"cannot limit {path} to {size_bytes} bytes: {e}") from e
    if done.returncode != 0:
        raise SpaceLimitUnavailable(f"cannot limit {path} to {size_bytes} bytes: `{' '.join(cmd)}` failed: "
                                    f"{(done.stderr or done.stdout).strip()[:300]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def grow_filesystem(path: Path, size_bytes: int) -> None:
    """Give the tmpfs at `path` (small_filesystem) more room, in place: the operator's fix for a full disk."""
    cmd = ["mount", "-o", f"remount,size={int(size_bytes)}", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise SpaceLimitUnavailable(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()[:300]}")


# ---- an MLflow tracking server that can be stopped --------------------------------------------------------
class MlflowServer:
    """`mlflow server` (SQLite backend, local artifacts) on a fixed port, stopped and started again: an outage
    of the tracking server with its data kept."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root, self.port = Path(root), port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, timeout_s: float = 180.0) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        mlflow = Path(sys.executable).with_name("mlflow")
        cmd = [str(mlflow) if mlflow.exists() else "mlflow", "server",
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--default-artifact-root", str(self.root / "artifacts"), "--serve-artifacts",
               "--artifacts-destination", str(self.root / "artifacts"),
               "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.root / f"server-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.starts += 1
        proc = self.proc

        def healthy() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}; see "
                                   f"{self.root / f'server-{self.starts - 1}.log'}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for(f"the MLflow server at {self.uri} to answer /health", healthy, timeout_s, interval_s=0.5)
        return self.uri

    def stop(self) -> None:
        """The whole server (its process group: gunicorn/uvicorn workers too) killed: connections are refused."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def outage(self, after_s: float, down_s: float) -> threading.Thread:
        """A thread: after `after_s`, stop the server; `down_s` later start it again on the same port."""
        def run() -> None:
            time.sleep(after_s)
            self.stop()
            time.sleep(down_s)
            self.start()

        t = threading.Thread(target=run, name="mlflow-outage", daemon=True)
        t.start()
        return t
