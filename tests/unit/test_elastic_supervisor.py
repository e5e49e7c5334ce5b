"""The supervisor's hang detection and restart budget, with the stub worker under real torchrun."""
from __future__ import annotations

import pytest

from recforge.config import ResourceConfig
from recforge.elastic.backends.base import JobFailedError
from recforge.elastic.job import run_training_job
from recforge.elastic.master.failover import FailoverPolicy
from recforge.elastic.policy import StaticPolicy
from test_elastic_local import SHARDS, stub_backend, stub_spec


def test_a_group_that_never_starts_is_killed_relaunched_and_the_budget_ends_it(tmp_path):
    """The stub hangs before it ever calls the master: the startup timeout applies."""
    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=1)
    recorded = []
    with pytest.raises(JobFailedError) as err:
        run_training_job(
            stub_spec(tmp_path / "out", hang=True), SHARDS, resources=res, state_dir=tmp_path / "job",
            policy=StaticPolicy(res, cpu_count=2), backend=stub_backend(max_restarts=0), timeout_s=120,
            failover=FailoverPolicy(max_relaunches=1, hang_timeout_s=60.0, startup_timeout_s=3.0), poll_s=0.2,
            on_attempt=recorded.append,
        )
    e = err.value
    assert "restart budget exhausted: 1 restart(s) used of 1" in str(e)
    assert "hang" in str(e) and "progress kept: master at epoch 0 of 2, 0 row(s) done" in str(e)
    attempts = e.attempts
    assert [a["outcome"] for a in attempts] == ["failed", "failed"]
    assert [a["generations"] for a in attempts] == [[0], [1]]  # every launch a fresh generation
    assert all(a["failure"].startswith("hang") for a in attempts)
    assert "relaunch" in attempts[0]["decision"] and "budget exhausted" in attempts[1]["decision"]
    # each launch's record reached on_attempt as its outcome was decided; only the first was relaunched
    assert [(a.generations, a.relaunched) for a in recorded] == [([0], True), ([1], False)]
    # the relaunched group appended to the workers' log: both launches' lines are there, in order
    log_text = (tmp_path / "job" / "workers.log").read_text()
    assert log_text.count(" launch: 2 worker(s)") == 2, log_text[:2000]
