"""LocalBackend: the job's workers as local processes under torch.distributed.run (torchrun).

`python -m torch.distributed.run --nnodes=1 --nproc-per-node=N --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:<free port> --max-restarts=R --monitor-interval=S -m MODULE SPEC`
runs in its own process group with OMP_NUM_THREADS=threads_per_worker; stdout and stderr of
torchrun and of every worker go to one log file. torchrun restarts the whole group up to R times
when a worker fails (workers see TORCHELASTIC_RESTART_COUNT, which MasterClient sends as its
launch generation).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

from recforge.elastic.backends.base import JobFailedError
from recforge.elastic.policy import ResourcePlan
from recforge.train.distributed import free_port

DEFAULT_WORKER_MODULE = "recforge.worker"


@dataclass
class LocalHandle:
    proc: subprocess.Popen
    cmd: list[str]
    log_path: Path
    plan: ResourcePlan
    rdzv_endpoint: str
    _log: IO[bytes] | None = field(default=None, repr=False)
    exit_code: int | None = None


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
        log = open(log_path, "wb")  # noqa: SIM115 (closed in wait/stop)
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=self.cwd, start_new_session=True,
        )
        return LocalHandle(proc=proc, cmd=cmd, log_path=log_path, plan=plan, rdzv_endpoint=endpoint, _log=log)

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
        try:
            with open(handle.log_path, "rb") as f:
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
