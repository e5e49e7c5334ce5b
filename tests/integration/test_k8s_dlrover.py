"""DLRover-RM stage 3 executed on the Kubernetes backend (kmock emulator + fake kubelet, see
test_k8s_backend): a launch whose pods stay Pending past the timeout is killed and relaunched smaller;
predicted memory exhaustion relaunches the pods with more memory. Each pod's workload is one rank of
the job master's protocol; every row is done exactly once."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from test_k8s_backend import KMOCK_PATH, OWNER, FakeKubelet, api, pods_of, settings  # noqa: F401 (api: fixture)

pytestmark = pytest.mark.skipif(not (KMOCK_PATH / "kmock").is_dir(),
                                reason=f"kmock emulator not installed at {KMOCK_PATH} (see test_k8s_backend)")

SHARDS = [24, 16]
GiB = 2**30


class Ranks:
    """The pods' workload: lease and report tasks; stop at the master's "stop" (like the worker's window
    hook); `task_s` per task. `done` counts every row reported done; `memory` the launches' pod requests."""

    def __init__(self, task_s: float = 0.0):
        self.task_s, self.done, self.memory, self.lock = task_s, Counter(), {}, threading.Lock()

    def __call__(self, pod) -> int:
        from recforge.elastic.agent.client import MasterClient

        self.memory[pod.metadata.labels["recforge.io/launch"]] = pod.spec.containers[0].resources.requests["memory"]
        spec = json.loads(Path(pod.spec.containers[0].args[-1]).read_text())
        c = MasterClient(spec["master_url"], pod.metadata.name, generation=spec["recovery"]["generation_base"],
                         max_attempts=2, poll_interval_s=0.02,
                         token=Path(spec["master_token_file"]).read_text().strip())
        c.join()
        while not c.finished:
            if c.command()["command"] == "stop":
                return 0
            t = c.lease()
            if t is not None and c.done(t.task_id, t.rows):
                with self.lock:
                    self.done.update((t.epoch, t.shard, r) for r in range(t.row_start, t.row_end))
            time.sleep(self.task_s)
        return 0

    def exactly_once(self) -> bool:
        expected = {(0, s, r) for s, n in enumerate(SHARDS) for r in range(n)}
        return set(self.done) == expected and set(self.done.values()) == {1}


def run_job(api_client, tmp_path, job_id: str, *, workers: int, memory: float, ranks: Ranks, config=None,
            table_bytes=(), pend=()):
    """Stage 1 (cold start), then the job under its DLRoverScaler on the emulated cluster."""
    from recforge.config import ResourceConfig
    from recforge.elastic.backends.kubernetes import KubernetesBackend, memory_quantity
    from recforge.elastic.job import run_training_job
    from recforge.elastic.master.dlrover_scaler import DLRoverScaler
    from recforge.elastic.optimizer import DLRoverPolicy, JobLimits, OptimizerConfig
    from recforge.elastic.policy import JobInfo, StaticPolicy

    res = ResourceConfig(policy="static", workers=workers, threads_per_worker=1, max_restarts=0, backend="kubernetes")
    policy = DLRoverPolicy(limits=JobLimits(cpu=4.0, memory=64 * GiB), default_model=None,
                           config=config or OptimizerConfig(profile_samples=100))
    policy.plan(JobInfo(shard_rows=SHARDS, epochs=1, rows_per_task=8, resources=res,
                        extra={"batch_size": 4, "memory_per_worker": memory, "table_bytes": list(table_bytes)}))
    scaler = DLRoverScaler(policy, min_interval_s=0.2, memory_action="more_memory")
    backend = KubernetesBackend(settings(job_id), memory=memory_quantity(memory), owner=OWNER, api_client=api_client,
                                poll_s=0.3)
    kubelet = FakeKubelet(api_client, workload=ranks, pend=pend)
    kubelet.start()
    try:
        result = run_training_job(
            {"train": {"epochs": 1, "batch_size": 4, "batches_per_task": 2, "lease_timeout_s": 600.0}}, SHARDS,
            resources=res, state_dir=tmp_path / "job", policy=StaticPolicy(res, cpu_count=4), backend=backend,
            scaler=scaler, timeout_s=60, poll_s=0.2,
        )
    finally:
        kubelet.stop()
    return result, scaler, kubelet


def test_pods_pending_too_long_are_relaunched_smaller(api, tmp_path):  # noqa: F811
    from recforge.elastic.optimizer import OptimizerConfig

    ranks = Ranks()
    result, scaler, kubelet = run_job(api, tmp_path, "t3", workers=2, memory=0.5 * GiB, ranks=ranks, pend={0},
                                      config=OptimizerConfig(profile_samples=100, pending_timeout_s=2.0))
    assert result.finished and result.restarts == 0 and result.plan.workers == 1
    assert [a["outcome"] for a in result.attempts] == ["rescaled", "finished"]
    assert result.attempts[0]["decision"].startswith("relaunch now 2 -> 1 worker(s): pending")
    (ev,) = [e for e in scaler.events if e.executed]
    assert ev.action == "relaunch_smaller" and ev.inputs["pending_s"] > 2.0 and ev.plan_after["workers"] == 1
    assert ranks.exactly_once() and list(ranks.memory) == ["1"]  # launch 0 never ran
    assert {n.rsplit("-", 1)[-1] for n in kubelet.seen} == {"l0", "l1"} and pods_of(api, "t3") == []


def test_predicted_memory_exhaustion_relaunches_the_pods_with_more_memory(api, tmp_path):  # noqa: F811
    """The memory model predicts 0.5 + 2 x 2 GiB for the worker holding a 2 GiB table: the group stops at
    the master's command and the next launch's pods ask for the event's memory (Kubernetes' answer)."""
    from recforge.elastic.backends.kubernetes import memory_bytes

    ranks = Ranks(task_s=0.3)  # slower than the profiler's polls: the decision comes mid-run
    result, scaler, _ = run_job(api, tmp_path, "t4", workers=1, memory=1 * GiB, ranks=ranks, table_bytes=[2 * GiB])
    assert result.finished and [a["outcome"] for a in result.attempts] == ["rescaled", "finished"]
    (ev,) = [e for e in scaler.events if e.executed]
    assert ev.action == "relaunch_workers_more_memory" and ev.prediction["peak_bytes"] == 4.5 * GiB
    assert ranks.memory["0"] == "1024Mi"
    assert memory_bytes(ranks.memory["1"]) == pytest.approx(ev.plan_after["memory_per_worker"], rel=1e-3)
    assert ranks.exactly_once()
