"""LocalBackend: the job's workers as local processes under torch.distributed.run (torchrun).

`python -m torch.distributed.run --nnodes=1 --nproc-per-node=N --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:<free port> --max-restarts=R --monitor-interval=S -m MODULE SPEC`
runs in its own process group with OMP_NUM_THREADS=threads_per_worker; stdout and stderr of
torchrun and of every worker go to one log file, appended to by every launch (a relaunched group
never overwrites the dead group's lines). torchrun restarts the whole group up to R times
when a worker fails (workers see TORCHELASTIC_RESTART_COUNT, which MasterClient sends as its
launch generation).

No orphans: torchrun gets SIGTERM when the launching thread's process dies (PR_SET_PDEATHSIG, SIGKILL
included) and stops its workers; `recforge.worker` sets the same on itself against torchrun.
`LogRelay` follows the log into a Python logger (the train task's Airflow log).
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from recforge.elastic.backends.base import JobFailedError
from recforge.elastic.policy import ResourcePlan
from recforge.train.distributed import free_port

DEFAULT_WORKER_MODULE = "recforge.worker"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_parent_death_signal(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Ask Linux to send `sig` to this process when the thread that started it exits (a killed parent
    included). Where the parent is already gone (`expected_parent` no longer ours) the signal is sent now.
    False where prctl is unavailable (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)  # the parent died before prctl took effect
    return True


@dataclass
class LocalHandle:
    proc: subprocess.Popen
    cmd: list[str]
    log_path: Path
    plan: ResourcePlan
    rdzv_endpoint: str
    _log: IO[bytes] | None = field(default=None, repr=False)
    exit_code: int | None = None
    log_offset: int = 0  # where this launch's lines start in the (appended) log


class LocalBackend:
    def __init__(
        self,
        module: str = DEFAULT_WORKER_MODULE,
        *,
        max_restarts: int = 3,
        monitor_interval_s: float = 1.0,
        log_dir: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        tail_lines: int = 80,
        stop_grace_s: float = 10.0,
    ) -> None:
        """`log_dir`: where `workers.log` goes (default: the spec's directory). `env`: extra
        environment variables for torchrun and the workers (on top of this process's)."""
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.module = module
        self.max_restarts = max_restarts
        self.monitor_interval_s = monitor_interval_s
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.env = dict(env or {})
        self.cwd = Path(cwd) if cwd is not None else None
        self.tail_lines = tail_lines
        self.stop_grace_s = stop_grace_s

    def command(self, spec_path: Path, plan: ResourcePlan, rdzv_endpoint: str) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=1",
            f"--nproc-per-node={plan.workers}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rdzv_endpoint}",
            f"--rdzv-id=recforge-{uuid.uuid4().hex[:12]}",
            f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval_s}",
            "-m", self.module, str(spec_path),
        ]

    def launch(self, spec_path: Path, plan: ResourcePlan) -> LocalHandle:
        spec_path = Path(spec_path).resolve()
        if not spec_path.exists():
            raise FileNotFoundError(f"worker spec not found: {spec_path}")
        log_dir = self.log_dir or spec_path.parent
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / "workers.log"
        endpoint = f"127.0.0.1:{free_port()}"
        cmd = self.command(spec_path, plan, endpoint)
        # Workers get their own TCPStore per restart: with torchrun's shared store (the default), a
        # restarted group can read the previous attempt's gloo/NCCL addresses and fail to connect
        # (pytorch/pytorch#135712).
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **os.environ, **self.env}
        env["OMP_NUM_THREADS"] = str(plan.threads_per_worker)
        env["MKL_NUM_THREADS"] = str(plan.threads_per_worker)
        env["PYTHONUNBUFFERED"] = "1"
        log = open(log_path, "ab")  # noqa: SIM115 (closed in wait/stop); appended: a relaunch keeps the dead group's
        offset = log.tell()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write((f"=== {stamp} launch: {plan.workers} worker(s) x {plan.threads_per_worker} thread(s), "
                   f"spec {spec_path}\n$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        parent = os.getpid()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=self.cwd, start_new_session=True,
            # torchrun stops its workers on SIGTERM; the workers themselves die with torchrun (recforge.worker)
            preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM, parent),
        )
        return LocalHandle(proc=proc, cmd=cmd, log_path=log_path, plan=plan, rdzv_endpoint=endpoint, _log=log,
                           log_offset=offset)

    def wait(self, handle: LocalHandle, timeout: float | None = None, check: bool = True) -> int | None:
        try:
            code = handle.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        self._finish(handle, code)
        if check and code != 0:
            tail = self.log_tail(handle)
            raise JobFailedError(
                f"training workers failed (torchrun exit code {code}, module {self.module}); "
                f"log: {handle.log_path}\n--- last lines ---\n{tail}",
                exit_code=code, log_path=handle.log_path, log_tail=tail,
            )
        return code

    def stop(self, handle: LocalHandle) -> None:
        """SIGTERM torchrun's process group (torchrun stops its workers), then SIGKILL whatever of the
        tree is left after `stop_grace_s` (workers live in their own sessions, so they are found first)."""
        if handle.proc.poll() is None:
            tree = _descendants(handle.proc.pid)
            _signal_group(handle.proc.pid, signal.SIGTERM)
            try:
                handle.proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(handle.proc.pid, signal.SIGKILL)
                handle.proc.wait()
            deadline = time.monotonic() + self.stop_grace_s
            for p in tree:
                _kill_when_alive(p, deadline)
        self._finish(handle, handle.proc.returncode)

    def worker_memory(self, handle: LocalHandle) -> list[float]:
        """Resident memory (bytes) of each worker process, by rank where the process says it (RANK)."""
        out = []
        try:
            children = psutil.Process(handle.proc.pid).children()  # torchrun's own children are the ranks
        except psutil.NoSuchProcess:
            return []
        for p in children:
            try:
                rank = p.environ().get("RANK")
                if rank is not None:
                    out.append((int(rank), float(p.memory_info().rss)))
            except (psutil.Error, ValueError):
                continue
        return [rss for _, rss in sorted(out)]

    def log_tail(self, handle: LocalHandle) -> str:
        """The last lines this launch wrote (earlier launches' lines stay in the file above them)."""
        try:
            with open(handle.log_path, "rb") as f:
                f.seek(handle.log_offset)
                lines = deque(f, maxlen=self.tail_lines)
        except FileNotFoundError:
            return "(no log)"
        return b"".join(lines).decode(errors="replace").rstrip()

    @staticmethod
    def _finish(handle: LocalHandle, code: int | None) -> None:
        handle.exit_code = code
        if handle._log is not None:
            handle._log.close()
            handle._log = None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_when_alive(proc, deadline: float) -> None:
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except psutil.TimeoutExpired:
        proc.kill()
    except psutil.NoSuchProcess:
        pass


# rank 0's lines, and warnings / errors of any rank, as recforge.worker formats them ("<time> rank<r> LEVEL name: msg")
_WORKER_LINE = re.compile(r"^\S+ \S+ rank(\d+) (INFO|WARNING|ERROR|CRITICAL) ")
_LEVELS = {"INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL}


class LogRelay:
    """Follows a workers' log from its current end and re-logs the workers' own lines (rank 0's, and warnings
    and errors of every rank) into `logger` every `interval_s`: per-step progress in the launching process's log.
    Use as a context manager; the rest is flushed on exit."""

    def __init__(self, path: str | Path, logger: logging.Logger, *, interval_s: float = 5.0,
                 select: Callable[[str], int | None] | None = None) -> None:
        self.path, self.logger, self.interval_s = Path(path), logger, interval_s
        self.select = select or worker_line_level
        self._pos = self.path.stat().st_size if self.path.exists() else 0
        self._partial = b""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.relayed = 0

    def poll(self) -> int:
        """Relay the complete lines written since the last poll; returns how many were relayed."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except FileNotFoundError:
            return 0
        self._pos += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        n = 0
        for raw in lines:
            line = raw.decode(errors="replace").rstrip()
            level = self.select(line)
            if level is not None:
                self.logger.log(level, "workers: %s", line)
                n += 1
        self.relayed += n
        return n

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as e:  # following a log must never take the job down
                self.logger.debug("log relay: %r", e)

    def __enter__(self) -> LogRelay:
        self._thread = threading.Thread(target=self._run, name="recforge-log-relay", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.poll()


def worker_line_level(line: str) -> int | None:
    """The level to relay a worker log line at: rank 0's INFO and up, other ranks' WARNING and up, else None."""
    m = _WORKER_LINE.match(line)
    if m is None:
        return None
    level = _LEVELS[m.group(2)]
    if m.group(1) != "0" and level < logging.WARNING:
        return None
    return level
