"""No orphans: when the process that launched a job dies (SIGKILL) or is cancelled (SIGTERM), torchrun and its
workers stop at once, so nothing overlaps a retry; a shutdown is not a failure: nothing is relaunched, whether
the owner got SIGTERM or torchrun / the ranks got it from outside (`make down`). Also the log relay that puts the
workers' progress into the launching process's log. Real torchrun with the stub worker
(tests/unit/elastic_stub_worker.py)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from recforge.config import ResourceConfig
from recforge.elastic.backends.local import LogRelay, worker_line_level
from recforge.elastic.job import run_training_job
from recforge.elastic.policy import StaticPolicy
from recforge.elastic.shutdown import JobCancelled
from test_elastic_local import SHARDS, stub_backend, stub_spec

HERE = Path(__file__).resolve().parent

# the "train task": launches a job whose two stub workers never finish, then waits on it; a relaunch would be
# allowed (max_restarts=1), each launch's record is printed as its outcome is decided
TASK = textwrap.dedent("""
    import sys
    from pathlib import Path
    from recforge.config import ResourceConfig
    from recforge.elastic.job import run_training_job
    from recforge.elastic.policy import StaticPolicy
    from test_elastic_local import SHARDS, stub_backend, stub_spec

    tmp = Path(sys.argv[1])
    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=1)
    run_training_job(stub_spec(tmp / "out", hang=True), SHARDS, resources=res, state_dir=tmp / "job",
                     policy=StaticPolicy(res, cpu_count=2), backend=stub_backend(max_restarts=0), timeout_s=300,
                     on_attempt=lambda a: print("ATTEMPT", a.outcome, a.relaunched, a.decision, flush=True))
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
    if sig == signal.SIGTERM:  # cancelled: the job's own cleanup stopped them, said why and relaunched nothing
        assert task.returncode != 0 and "JobCancelled" in out, out[-3000:]
        attempts = [line for line in out.splitlines() if line.startswith("ATTEMPT ")]
        assert len(attempts) == 1 and attempts[0].startswith("ATTEMPT stopped False shutdown, not relaunched"), out
        assert (tmp_path / "job" / "workers.log").read_text().count(" launch: ") == 1


def _ranks_running(out: Path, timeout_s: float) -> list[int]:
    """The pids of both stub ranks once they run (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while len(ranks := list(out.glob("running-*"))) < 2:
        if time.monotonic() > deadline:
            raise AssertionError(f"the two stub ranks did not start within {timeout_s}s")
        time.sleep(0.1)
    return [int(p.name.split("-")[2]) for p in ranks]


@pytest.mark.parametrize("target", ["torchrun", "ranks"])
def test_a_group_terminated_from_outside_is_a_shutdown_not_a_failure(tmp_path, target):
    """`make down` sends SIGTERM to every process of the platform, torchrun and the ranks possibly before the job's
    owner: the supervisor sees the group exit, and must not relaunch it although the budget allows one."""
    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=2)
    recorded, signalled, errors = [], [], []

    def terminate() -> None:  # from outside the job, while its owner (this process) runs on
        try:
            ranks = _ranks_running(tmp_path / "out", timeout_s=120)
            if target == "torchrun":
                pids = [p.pid for p in psutil.Process().children() if "torch.distributed.run" in " ".join(
                    p.cmdline())]
            else:
                pids = ranks
            signalled.extend(pids + ranks)
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    helper = threading.Thread(target=terminate, daemon=True)
    helper.start()
    with pytest.raises(JobCancelled, match="from outside the job"):
        run_training_job(stub_spec(tmp_path / "out", hang=True), SHARDS, resources=res, state_dir=tmp_path / "job",
                         policy=StaticPolicy(res, cpu_count=2), backend=stub_backend(max_restarts=0), timeout_s=300,
                         on_attempt=recorded.append, poll_s=0.2)
    helper.join(timeout=10)
    assert not errors and signalled, errors
    assert [(a.outcome, a.relaunched) for a in recorded] == [("stopped", False)], recorded
    assert "received SIGTERM from outside the job" in recorded[0].decision
    assert (tmp_path / "job" / "workers.log").read_text().count(" launch: ") == 1
    assert _gone(signalled, timeout_s=20) == []


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


def test_one_sigterm_mechanism_nests_raises_once_and_restores():
    """Stage inside task inside job: the innermost block's exception, listeners and the replaced handler run once,
    a second SIGTERM during the cleanup is ignored, and every handler is back in place afterwards."""
    from recforge.elastic.shutdown import on_shutdown, shutting_down, sigterm_raises
    from recforge.pipelines.stage import StageCancelled
    from recforge.pipelines.stage import sigterm_raises as stage_sigterm_raises

    calls, heard = [], []

    def airflow_handler(signum, frame):
        calls.append(signum)

    def wait_for_signal() -> None:  # the handler raises at the next bytecode; bounded regardless
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.01)
        raise AssertionError("SIGTERM was not handled within 30 s")

    previous = signal.signal(signal.SIGTERM, airflow_handler)
    try:
        with pytest.raises(JobCancelled) as err, stage_sigterm_raises(), on_shutdown(heard.append):
            with sigterm_raises():
                os.kill(os.getpid(), signal.SIGTERM)
                wait_for_signal()
        assert type(err.value) is JobCancelled  # the innermost block's, not the stage's StageCancelled
        assert calls == [signal.SIGTERM] and heard == [str(err.value)]
        assert signal.getsignal(signal.SIGTERM) is airflow_handler and shutting_down() is None

        with pytest.raises(StageCancelled), stage_sigterm_raises():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                wait_for_signal()
            finally:  # the cleanup: a second SIGTERM must not break it
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)
        assert calls == [signal.SIGTERM] * 2  # once per cancellation
    finally:
        signal.signal(signal.SIGTERM, previous)
