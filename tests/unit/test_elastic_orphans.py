"""No orphans: when the process that launched a job dies (SIGKILL) or is cancelled (SIGTERM), torchrun and its
workers stop at once, so nothing overlaps a retry. Also the log relay that puts the workers' progress into the
launching process's log. Real torchrun with the stub worker (tests/unit/elastic_stub_worker.py)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from recforge.elastic.backends.local import LogRelay, worker_line_level

HERE = Path(__file__).resolve().parent

# the "train task": launches a job whose two stub workers never finish, then waits on it
TASK = textwrap.dedent("""
    import sys
    from pathlib import Path
    from recforge.config import ResourceConfig
    from recforge.elastic.job import run_training_job, sigterm_cancels_job
    from recforge.elastic.policy import StaticPolicy
    from test_elastic_local import SHARDS, stub_backend, stub_spec

    tmp = Path(sys.argv[1])
    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=0)
    with sigterm_cancels_job():
        run_training_job(stub_spec(tmp / "out", hang=True), SHARDS, resources=res, state_dir=tmp / "job",
                         policy=StaticPolicy(res, cpu_count=2), backend=stub_backend(max_restarts=0), timeout_s=300)
""")


def _gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running (zombies count as gone) after waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_workers_die_with_the_task_process(tmp_path, sig):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    task = subprocess.Popen([sys.executable, "-c", TASK, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "out").glob("running-*"))) < 2:  # both workers run
            assert task.poll() is None and time.monotonic() < deadline, task.communicate(timeout=10)[0].decode()
            time.sleep(0.1)
        workers = [int(p.name.split("-")[2]) for p in (tmp_path / "out").glob("running-*")]
        torchrun = [p.pid for p in psutil.Process(task.pid).children() if "torch.distributed.run" in " ".join(
            p.cmdline())]
        assert len(torchrun) == 1
        task.send_signal(sig)
        out = task.communicate(timeout=60)[0].decode()
    finally:
        if task.poll() is None:
            task.kill()
    left = _gone(torchrun + workers, timeout_s=20)
    for pid in left:  # don't leave the orphans of a failed test behind
        os.kill(pid, signal.SIGKILL)
    assert left == [], out[-3000:]
    if sig == signal.SIGTERM:  # cancelled: the job's own cleanup stopped them and said why
        assert task.returncode != 0 and "JobCancelled" in out, out[-3000:]


def test_log_relay_follows_rank0_and_every_warning(tmp_path, caplog):
    path = tmp_path / "workers.log"
    path.write_text("2026-01-01 00:00:00,000 rank0 INFO old: before the relay started\n")
    logger = logging.getLogger("test.relay")
    with caplog.at_level(logging.INFO, logger="test.relay"):
        relay = LogRelay(path, logger, interval_s=3600)
        with open(path, "a") as f:
            f.write("2026-01-01 00:00:01,000 rank0 INFO recforge.train.loop.step_loop: epoch 0 step 20: train loss "
                    "0.5\n2026-01-01 00:00:01,000 rank1 INFO x: not rank 0\n[rank1]: torch noise\n"
                    "2026-01-01 00:00:02,000 rank1 WARNING x: a warning of rank 1\n2026-01-01 00:00:03,000 rank0 INF")
        assert relay.poll() == 2
        with open(path, "a") as f:  # the torn line completes later
            f.write("O y: step 40\n")
        assert relay.poll() == 1
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(": ", 1)[1].split(" ", 2)[2] for m in messages] == [
        "rank0 INFO recforge.train.loop.step_loop: epoch 0 step 20: train loss 0.5",
        "rank1 WARNING x: a warning of rank 1", "rank0 INFO y: step 40"]
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING, logging.INFO]
    assert worker_line_level("garbage") is None
