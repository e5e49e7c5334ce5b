"""The causes of DLRover-RM's lost CPU and memory in the simulator (issue 17): pending relaunches that kept the pod
memory of twice the workers, histories of worker peaks without the embedding shard, and scaling whose relaunch
pause the job never earns back."""
from __future__ import annotations

from dataclasses import replace

import pytest

from recforge.elastic.optimizer import (
    InstabilityStage,
    JobDescription,
    JobLimits,
    Observation,
    OptimizerConfig,
    PodPlan,
    RuntimeStage,
    ThroughputModel,
    embedding_shard_bytes,
)
from recforge.elastic.optimizer.models.throughput_model import Allocation, _cols
from recforge.elastic.simulate import truth
from recforge.elastic.simulate.cluster import ClusterSpec
from recforge.elastic.simulate.engine import SimParams, Simulation
from recforge.elastic.simulate.policies import GENERIC_TR_PRIOR, SIM_CONFIG, SimPolicy, make_policy
from recforge.elastic.simulate.trace import TraceParams, generate_trace

GiB = float(1 << 30)
TABLES = (8 * GiB,) * 8
REQ = PodPlan(workers=8, cpu_per_worker=4.0, memory_per_worker=12 * GiB, batch_size=1024)
TR_JOB = JobDescription("d", "dlrm", REQ, total_samples=1e9, table_bytes=TABLES)
LIMITS = JobLimits(cpu=64, memory=2000 * GiB, max_memory_per_pod=120 * GiB)


def test_a_pending_torchrec_job_relaunched_with_half_the_workers_gets_their_shard_memory():
    st = InstabilityStage(TR_JOB, LIMITS, OptimizerConfig(pending_timeout_s=900))
    ev = st.observe(Observation(0, REQ, pending_s=1000))
    new = PodPlan.from_dict(ev[0].plan_after)
    assert ev[0].action == "relaunch_smaller" and new.workers == 4
    grown = embedding_shard_bytes(TABLES, 4) - embedding_shard_bytes(TABLES, 8)
    assert new.memory_per_worker == pytest.approx(REQ.memory_per_worker + 1.2 * grown)
    # a parameter-server job's workers hold no shard: only the count changes
    ps = InstabilityStage(replace(TR_JOB, parameter_server=True), LIMITS, OptimizerConfig(pending_timeout_s=900))
    assert PodPlan.from_dict(ps.observe(Observation(0, REQ, pending_s=1000))[0].plan_after).memory_per_worker \
        == REQ.memory_per_worker


def test_a_shard_too_big_for_a_pod_halves_the_cores_instead():
    tight = replace(LIMITS, max_memory_per_pod=20 * GiB)
    ev = InstabilityStage(TR_JOB, tight, OptimizerConfig(pending_timeout_s=900)).observe(
        Observation(0, REQ, pending_s=1000))
    new = PodPlan.from_dict(ev[0].plan_after)
    assert (new.workers, new.cpu_per_worker, new.memory_per_worker) == (8, 2.0, REQ.memory_per_worker)


def _obs(t, plan, rate, step, total):
    return Observation(t, plan, samples_per_s=rate, step=step, worker_cpu_util=[0.95] * 4,
                       worker_memory=[0.7 * plan.memory_per_worker] * 4, total_steps=total)


@pytest.mark.parametrize("relaunch_s, left_steps, scales", [(0.0, 10, True), (120.0, 10, False),
                                                            (120.0, 10_000_000, True)])
def test_stage2_scales_only_when_the_time_saved_pays_for_the_relaunch(relaunch_s, left_steps, scales):
    model = ThroughputModel(("const", "b_per_cpu", "log_w"), (0.01, 1e-3, 0.001))
    cfg = OptimizerConfig(relaunch_s=relaunch_s, rightsize=False, profile_samples=1, interval_s=0.0)
    plan = replace(REQ, workers=2, cpu_per_worker=2.0)
    st = RuntimeStage(TR_JOB, LIMITS, cfg, model)
    rate = model.predict(plan.allocation())
    ev = st.observe(_obs(0.0, plan, rate, step=100, total=100 + left_steps))
    changed = [e for e in ev if e.changes_plan]
    assert bool(changed) == scales
    if not scales:
        assert ev and ev[0].reason.startswith("payoff") and ev[0].plan_after is None


def test_the_simulator_configures_the_optimizers_relaunch_pause():
    assert SIM_CONFIG.relaunch_s == SimParams().resize_pods_s
    assert make_policy("dlrover").config.relaunch_s == SimParams().resize_pods_s
    assert make_policy("dlrover-nopayoff").config.relaunch_s == 0.0


class _Recorder(SimPolicy):
    name = "recorder"
    observes = False

    def __init__(self) -> None:
        self.peaks: dict[int, float] = {}

    def on_finish(self, job, plan, state) -> None:
        self.peaks[job.job_id] = state["peak_worker_mem"]


def test_a_finished_torchrec_job_reports_its_peak_with_the_embedding_shard():
    tr = generate_trace(TraceParams(n_jobs=6, arrival_window_h=1.0, n_scenarios=3), seed=0)
    for j in tr:  # room to finish: no out-of-memory restarts
        j.request["memory_per_worker"] = 120 * GiB
    pol = _Recorder()
    Simulation(tr, pol, ClusterSpec(nodes=40), SimParams(), 0).run()
    assert pol.peaks
    for j in tr:
        if j.job_id in pol.peaks:
            w = j.request["workers"]
            end = truth.tr_worker_memory(j.worker_mem, j.emb_bytes, w, j.emb_growth_per_sample * j.total_samples)
            assert pol.peaks[j.job_id] == pytest.approx(end, rel=1e-6) and pol.peaks[j.job_id] > j.worker_mem


def test_model_columns_are_the_allocations_fields():
    allocs = [Allocation(3, 2.0, 512), Allocation(4, 1.0, 256, servers=2, cpu_per_server=3.0, host_cores=8.0)]
    v = _cols(allocs)
    assert v["w"].tolist() == [3, 4] and v["c"].tolist() == [2, 1] and v["b"].tolist() == [512, 256]
    assert v["p"].tolist() == [0, 2] and v["cp"].tolist() == [1, 3] and v["host"].tolist() == [float("inf"), 8]
    assert _cols([])["w"].shape == (0,)
    assert GENERIC_TR_PRIOR.predict(allocs[0]) > 0


def test_the_bucket_bound_refuses_only_placements_the_scan_also_refuses():
    import numpy as np

    from recforge.elastic.simulate.cluster import Cluster

    rng = np.random.default_rng(3)
    spec = ClusterSpec(nodes=12, cpu_per_node=32.0, memory_per_node=128 * GiB)
    fast, slow = Cluster(spec, bound=True), Cluster(spec, bound=False)
    held: list = []
    refused = 0
    for _ in range(400):
        if held and rng.random() < 0.4:
            pods, where = held.pop(int(rng.integers(len(held))))
            fast.release(pods, where)
            slow.release(pods, where)
            continue
        pod = (float(rng.integers(1, 20)), float(rng.uniform(1, 60)) * GiB)
        pods = [pod] * int(rng.integers(1, 9))
        a, b = fast.place(pods), slow.place(pods)
        assert a == b
        refused += a is None
        if a is not None:
            held.append((pods, a))
        assert np.array_equal(fast.free_cpu, slow.free_cpu) and np.array_equal(fast.free_mem, slow.free_mem)
        assert np.array_equal(fast._hc, np.bincount(fast._bc(fast.free_cpu), minlength=fast._kc))
        assert np.array_equal(fast._hm, np.bincount(fast._bm(fast.free_mem), minlength=fast._km))
    assert refused > 20  # the cluster was full often enough for the bound to matter
