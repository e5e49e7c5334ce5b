"""LocalBackend: the job's workers as local processes under torch.distributed.run (torchrun).

`python -m torch.distributed.run --nnodes=1 --nproc-per-node=N --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:<free port> --max-restarts=R --monitor-interval=S -m MODULE SPEC`
runs in its own process group with OMP_NUM_THREADS=threads_per_worker; stdout and stderr of
torchrun and of every worker go to one log file, appended to by every launch (a relaunched group
never overwrites the dead group's lines). torchrun restarts the whole group up to R times
when a worker fails (workers see TORCHELASTIC_RESTART_COUNT, which MasterClient sends as its
launch generation).

No orphans (docs/fault_tolerance.md#shutdown-and-orphans): torchrun gets SIGKILL the moment the process that
launched it dies (PR_SET_PDEATHSIG, a SIGKILL of that process included; torchrun's own SIGTERM path would give its
workers a 30 s grace), and every rank kills itself with torchrun (`die_with_launcher`, called by recforge.worker).
`stop` terminates torchrun and every worker's process group together and SIGKILLs what is left after a grace;
`cleanup` stops every group this backend launched. A group that exited because someone else sent it SIGTERM
(`terminated_by`) is a shutdown, which the supervisor does not relaunch.
`LogRelay` follows the log into a Python logger (the train task's Airflow log).
"""
from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from recforge.elastic.allocator_env import allocator_env, allocator_mode
from recforge.elastic.backends.base import JobFailedError
from recforge.elastic.policy import ResourcePlan
from recforge.train.distributed import free_port

log = logging.getLogger(__name__)

DEFAULT_WORKER_MODULE = "recforge.worker"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# termination requests: a group that exits on one of these, sent by someone else, was shut down, not failed
_TERMINATION = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}
# torchrun's own lines when it (or a rank) dies of a signal (torch.distributed.elastic, agent/server/api.py and the
# error summary of multiprocessing/errors)
_AGENT_SIGNALLED = re.compile(r"Received (\d+|SIG[A-Z]+) death signal, shutting down workers")
_RANK_SIGNALLED = re.compile(r"Signal (\d+) \((SIG[A-Z]+)\) received by PID (\d+)")


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


def die_with_launcher() -> bool:
    """For a rank under torchrun, first thing: SIGKILL this process when torchrun exits (killed included), and
    die now if torchrun is already gone. False outside torchrun or where prctl is unavailable."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    if not set_parent_death_signal(signal.SIGKILL, parent):
        return False
    try:  # torchrun died before this process read its parent: the parent is a reaper now
        launcher = Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        launcher = b""
    if b"torch.distributed.run" not in launcher and b"torchrun" not in launcher:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


_DEFERRED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGTERM / SIGINT / SIGHUP in this thread while a group is started and recorded: a shutdown delivered
    in between would raise after the fork but before `cleanup` can find the group. Delivered right after."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


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
    stopped: bool = False  # stop() ended the group (its exit is not the group's own)


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
        allocator: str = "kept",
    ) -> None:
        """`log_dir`: where `workers.log` goes (default: the spec's directory). `env`: extra
        environment variables for torchrun and the workers (on top of this process's). `allocator`: the workers'
        allocator mode (config resources.allocator; env RECFORGE_ALLOCATOR overrides it)."""
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
        allocator_mode({}, allocator)  # a bad mode fails here, naming the config field
        self.allocator = allocator
        self._live: list[LocalHandle] = []  # launched and not yet seen to exit (cleanup stops them)

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
        env.update(allocator_env(env, self.allocator))  # the ranks keep freed pages (recforge.elastic.allocator_env)
        # torchrun's own grace between SIGTERM and SIGKILL of its ranks (default 30 s)
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(max(1, int(self.stop_grace_s))))
        log_file = open(log_path, "ab")  # noqa: SIM115 (closed in wait/stop); appended: a relaunch keeps the dead group's
        offset = log_file.tell()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log_file.write((f"=== {stamp} launch: {plan.workers} worker(s) x {plan.threads_per_worker} thread(s), "
                        f"spec {spec_path}\n$ " + " ".join(cmd) + "\n").encode())
        log_file.flush()
        parent = os.getpid()

        def in_child() -> None:  # torchrun dies with this process; the ranks die with torchrun (die_with_launcher)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _DEFERRED)
            set_parent_death_signal(signal.SIGKILL, parent)

        with _signals_deferred():
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=self.cwd, start_new_session=True, preexec_fn=in_child,
            )
            handle = LocalHandle(proc=proc, cmd=cmd, log_path=log_path, plan=plan, rdzv_endpoint=endpoint,
                                 _log=log_file, log_offset=offset)
            self._live.append(handle)
        return handle

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
        """SIGTERM torchrun's process group and every worker's (the ranks live in sessions of their own, so the
        tree is noted first), then SIGKILL whatever is left after `stop_grace_s`. Idempotent."""
        if handle.proc.poll() is None:
            handle.stopped = True
            tree = _descendants(handle.proc.pid)
            for pgid in [handle.proc.pid, *(p.pid for p in tree)]:
                _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_grace_s
            try:
                handle.proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                log.warning("torchrun (pid %d) did not stop within %.0fs of SIGTERM: SIGKILL", handle.proc.pid,
                            self.stop_grace_s)
                _signal_group(handle.proc.pid, signal.SIGKILL)
                handle.proc.wait(timeout=self.stop_grace_s)  # SIGKILL: bounded all the same (a D-state process)
            for p in tree:
                _kill_when_alive(p, deadline)
        self._finish(handle, handle.proc.returncode)

    def cleanup(self) -> None:
        """Stop every group this backend launched that still runs (run_training_job calls it on the way out)."""
        for handle in list(self._live):
            self.stop(handle)

    def terminated_by(self, handle: LocalHandle) -> str | None:
        """Why the group exited, when it was a termination signal (SIGTERM, SIGINT, SIGHUP, SIGQUIT) that someone
        other than this backend sent to torchrun or to a rank: a shutdown, not a failure. None otherwise."""
        if handle.stopped or handle.exit_code in (0, None):
            return None
        tail = self.log_tail(handle)
        for m in _AGENT_SIGNALLED.finditer(tail):
            name = m.group(1) if m.group(1).startswith("SIG") else _signal_name(int(m.group(1)))
            if name in _TERMINATION:
                return f"torchrun received {name} from outside the job"
        # torchrun SIGTERMs the rest of a group once a rank failed and lists those too: only the first observed
        # failure tells why the group ended
        _, header, root = tail.rpartition("Root Cause (first observed failure):")
        first = _RANK_SIGNALLED.search(root.split("=" * 20)[0]) if header else None
        if first is not None and first.group(2) in _TERMINATION:
            return f"a rank (pid {first.group(3)}) received {first.group(2)} from outside the job, the first to fail"
        return None

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

    def _finish(self, handle: LocalHandle, code: int | None) -> None:
        handle.exit_code = code
        if handle in self._live and code is not None:
            self._live.remove(handle)
        if handle._log is not None:
            handle._log.close()
            handle._log = None


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal the process group `pgid` (a session leader's pid is its group's id); gone already: nothing."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


def _descendants(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_when_alive(proc: psutil.Process, deadline: float) -> None:
    """Wait for `proc` until `deadline`, then SIGKILL it and its process group."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except psutil.TimeoutExpired:
        log.warning("worker process %d outlived its grace: SIGKILL", proc.pid)
        with contextlib.suppress(psutil.Error):
            proc.kill()
        _signal_group(proc.pid, signal.SIGKILL)
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
