"""Policy, LocalBackend and run_training_job with a stub worker under real torch.distributed.run.

The stub (tests/unit/elastic_stub_worker.py) speaks the master protocol and all_reduces over gloo
like the real worker, without training a model.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import pytest

from recforge.config import ResourceConfig
from recforge.elastic.backends.base import Backend, JobFailedError
from recforge.elastic.backends.local import LocalBackend
from recforge.elastic.job import run_training_job
from recforge.elastic.policy import JobInfo, OversubscriptionWarning, Policy, ResourcePlan, StaticPolicy

HERE = Path(__file__).resolve().parent
SHARDS = [20, 13, 7]  # 40 rows; batch 4 x 2 batches per task = 8 rows: 6 tasks per epoch


def stub_backend(**kw) -> LocalBackend:
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return LocalBackend("elastic_stub_worker", env={"PYTHONPATH": pythonpath}, monitor_interval_s=0.2, **kw)


def stub_spec(out: Path, **extra) -> dict:
    return {"train": {"epochs": 2, "batch_size": 4, "batches_per_task": 2, "lease_timeout_s": 600.0},
            "output_dir": str(out), **extra}


def test_static_policy_returns_the_config_and_warns_on_oversubscription():
    res = ResourceConfig(policy="static", workers=3, threads_per_worker=2)
    job = JobInfo(shard_rows=[10], epochs=1, rows_per_task=5, resources=res)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert StaticPolicy(res, cpu_count=6).plan(job) == ResourcePlan(workers=3, threads_per_worker=2)
    with pytest.warns(OversubscriptionWarning, match="exceeds the 4 CPU cores"):
        assert StaticPolicy(res, cpu_count=4).plan(job) == ResourcePlan(3, 2)
    assert isinstance(StaticPolicy(res), Policy) and isinstance(LocalBackend(), Backend)
    with pytest.raises(ValueError):
        ResourcePlan(workers=0, threads_per_worker=1)


def test_local_backend_command_line():
    cmd = LocalBackend(max_restarts=2).command(Path("/s.json"), ResourcePlan(3, 1), "127.0.0.1:1234")
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    for flag in ("--nnodes=1", "--nproc-per-node=3", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1234",
                 "--max-restarts=2"):
        assert flag in cmd
    assert cmd[-3:] == ["-m", "recforge.worker", "/s.json"]


def test_run_training_job_with_two_real_processes(tmp_path):
    out = tmp_path / "out"
    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=0)
    result = run_training_job(
        stub_spec(out), SHARDS, resources=res, state_dir=tmp_path / "job",
        policy=StaticPolicy(res, cpu_count=2), backend=stub_backend(max_restarts=0), timeout_s=120,
    )
    assert result.exit_code == 0 and result.finished and not result.poisoned
    assert result.samples == sum(SHARDS) * 2 and result.tasks_done == 12
    assert set(result.per_worker) == {"rank0-g0", "rank1-g0"}
    assert all(w["tasks_done"] > 0 for w in result.per_worker.values())
    worker_out = json.loads((out / "result.json").read_text())
    # the ranks' all_reduce of their consumed rows adds up to every row of both epochs
    assert worker_out == {"world_size": 2, "rows": 80, "generation": 0, "omp_num_threads": "1", "finished": True}
    spec = json.loads(result.spec_path.read_text())
    assert spec["master_url"].startswith("http://127.0.0.1:") and spec["threads_per_worker"] == 1
    assert result.log_path.exists()


def test_crashed_worker_is_restarted_and_its_rows_come_back(tmp_path):
    """Rank 1 dies holding a lease; torchrun restarts the group; the new generation's first call
    takes back the dead leases at once (the lease timeout is far longer than the job's timeout)."""
    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=1)
    result = run_training_job(
        stub_spec(tmp_path / "out", crash_rank=1), SHARDS, resources=res, state_dir=tmp_path / "job",
        policy=StaticPolicy(res, cpu_count=2), backend=stub_backend(max_restarts=1), timeout_s=120,
    )
    assert result.exit_code == 0 and result.finished
    assert result.samples == sum(SHARDS) * 2  # every row credited exactly once
    assert result.master_state["generation"] == 1
    assert {"rank0-g1", "rank1-g1"} <= set(result.per_worker)
    before_crash = sum(w["samples"] for name, w in result.per_worker.items() if name.endswith("-g0"))
    assert 0 < before_crash < 80
    after = json.loads((tmp_path / "out" / "result.json").read_text())
    # the restarted group consumed exactly the rows not credited before the crash, leftovers included
    assert after["generation"] == 1 and after["rows"] == 80 - before_crash


def test_failing_worker_surfaces_the_log_tail(tmp_path):
    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=0)
    with pytest.raises(JobFailedError) as err:
        run_training_job(
            stub_spec(tmp_path / "out", fail="stub worker failed on purpose: marker-7781"), SHARDS,
            resources=res, state_dir=tmp_path / "job", policy=StaticPolicy(res, cpu_count=2),
            backend=stub_backend(max_restarts=0), timeout_s=120,
        )
    e = err.value
    assert e.exit_code not in (0, None)
    assert "marker-7781" in str(e) and "marker-7781" in e.log_tail
    assert str(e.log_path) in str(e) and e.log_path.exists()


def test_stop_kills_the_whole_process_tree(tmp_path):
    import psutil

    out = tmp_path / "out"
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps({"hang": True, "output_dir": str(out)}))
    backend = stub_backend(max_restarts=0, log_dir=tmp_path)
    handle = backend.launch(spec_path, ResourcePlan(workers=2, threads_per_worker=1))
    try:
        for _ in range(1200):  # bounded wait until both workers run
            if len(list(out.glob("running-*"))) == 2 or handle.proc.poll() is not None:
                break
            time.sleep(0.05)
        pids = [int(p.name.split("-")[2]) for p in out.glob("running-*")]
        assert len(pids) == 2, backend.log_tail(handle)
        assert backend.wait(handle, timeout=0.1) is None  # still running
    finally:
        backend.stop(handle)
    assert handle.exit_code is not None and handle.exit_code != 0
    for pid in [handle.proc.pid, *pids]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    backend.stop(handle)  # idempotent
