"""The pipeline's profiling step and the simulator's prediction in the co-run schedule: a stored profile is
reused (not re-measured) and logged; the proxy's size cap; the simulator's kernel costs are the executor's
groups, scaled in rows; the prediction of the schedule's meta at the two capacity extremes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from recforge.config import ModelConfig, PipelineConfig
from recforge.preprocess.planning.compiler import FusedGroup, compile_plan
from recforge.rap.planning.job_schedule import measured_kernel_cost, plan_schedule, simulated_iteration_ms
from recforge.rap.planning.simulator import METHODS
from recforge.rap.profiling.profile_job import (
    CPU_THRESHOLD,
    MAX_UNITS,
    PROXY_BYTES,
    STEPS_PER_POINT,
    WARMUP,
    ensure_profile,
    proxy_units,
    single_rank_group,
)
from recforge.rap.profiling.profiler import ProfileKey, StageProfile
from recforge.rap.profiling.stages import STAGES
from test_rap_runtime import DS, PLAN, manifest_dir  # noqa: F401 (a fixture)

MODEL = ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1])
STAGE_MS = {"emb_fwd": 4.0, "mlp_fwd": 6.0, "mlp_bwd": 8.0, "emb_bwd": 3.0, "allreduce": 2.0}


def _profile(capacity: float, world: int = 1, batch: int = 64, device: str = "cpu") -> StageProfile:
    return StageProfile(key=ProfileKey.of(MODEL, PLAN.tables(), world, batch, device), stage_ms=dict(STAGE_MS),
                        capacity_units={s: 1 for s in STAGES}, capacity_ms={s: capacity for s in STAGES},
                        unit_ms=0.01, threshold=0.1)


def nodes_cost(compiled, group: FusedGroup) -> float:
    """A deterministic stand-in for the timer: 0.5 ms a launch + 0.25 ms a node."""
    return 0.5 + 0.25 * len(group.nodes)


def test_proxy_units_outlast_the_longest_stage_within_the_caps():
    assert proxy_units(128, longest_stage_ms=1.0, unit_ms=0.1) == 32  # 2 x 1 ms / 0.1 ms = 20 -> 32
    assert proxy_units(128, longest_stage_ms=0.01, unit_ms=1.0) == 4  # at least 4
    assert proxy_units(128, longest_stage_ms=1e3, unit_ms=1e-3) == MAX_UNITS
    rows = 1 << 20
    assert proxy_units(rows, 1e3, 1e-3) == PROXY_BYTES // (rows * 128)  # memory cap


def test_single_rank_group_is_torn_down():
    if dist.is_initialized():
        pytest.skip("another test's process group is up")
    with single_rank_group():
        assert dist.get_world_size() == 1
        with single_rank_group():  # nested: reuses the one there
            assert dist.get_world_size() == 1
    assert not dist.is_initialized()


def test_kernel_cost_maps_simulator_groups_onto_the_executor_and_scales_rows():
    compiled = compile_plan(PLAN, method="milp")
    cost = measured_kernel_cost(compiled, lambda g: nodes_cost(compiled, g), batch_size=64)
    sim = compile_plan(PLAN, method="milp")  # the simulator's own compilation of the same features
    for g in sim.groups:
        assert cost(sim, g, lambda n: 64.0) == pytest.approx(nodes_cost(compiled, g))
        assert cost(sim, g, lambda n: 128.0) == pytest.approx(2 * nodes_cost(compiled, g))
        one = FusedGroup(g.layer, g.op, g.cls, g.nodes[:1])  # an unfused launch (sequential, rap_no_fusion)
        assert cost(sim, one, lambda n: 64.0) == pytest.approx(0.75)
    other = FusedGroup(sim.groups[0].layer, "no_such_op", sim.groups[0].cls, sim.groups[0].nodes)
    with pytest.raises(ValueError, match="no single counterpart"):
        cost(sim, other, lambda n: 64.0)


@pytest.mark.parametrize("capacity", [0.0, 1e3])
def test_simulated_rap_at_capacity_extremes(capacity):
    compiled = compile_plan(PLAN, method="milp")
    sim = simulated_iteration_ms(PLAN, compiled, lambda g: nodes_cost(compiled, g), _profile(capacity), 64)
    assert set(sim) == set(METHODS)
    assert sim["ideal"] == pytest.approx(sum(STAGE_MS.values()))
    fused_total = sum(nodes_cost(compiled, g) for g in compiled.groups)
    # no room: every fused kernel is unhidden (leftovers in the last stage); all the room: nothing is
    assert sim["rap"] == pytest.approx(sim["ideal"] + (fused_total if capacity == 0 else 0.0), abs=1e-3)
    unfused = sum(0.75 * len(g.nodes) for g in compiled.groups)
    assert sim["sequential"] == pytest.approx(sim["ideal"] + unfused, abs=1e-3)


def test_plan_schedule_puts_the_simulated_prediction_in_the_meta():
    # a GPU profile: RAP's schedule as it is (on a CPU one, cpu_start_choice may replace it: tested below)
    sched = plan_schedule(PLAN, DS, MODEL, world_size=1, batch_size=64, stage="emb_bwd", profile_dir=None,
                          profile=_profile(1e3, device="cuda"))
    assert sched.meta["source"].startswith("RAP scheduler over stage profile")
    assert sched.meta["predicted_iteration_ms"] == sched.meta["simulated_iteration_ms"]["rap"]
    # all hidden: the simulator and the scheduler's own sum agree on the profiled stages
    assert sched.meta["predicted_iteration_ms"] == pytest.approx(sum(STAGE_MS.values()), abs=1e-3)
    assert sched.meta["scheduler_iteration_ms"] == pytest.approx(sum(STAGE_MS.values()))


def test_ensure_profile_reuses_a_stored_profile_and_logs_it(recforge_home, tmp_path):
    from recforge.tracking import TrackingStore

    cfg = PipelineConfig(model=MODEL, train={"batch_size": 64})
    stored = _profile(2.0)
    stored.save(tmp_path / "profiles")
    store = TrackingStore()
    run = store.stage_run("rap-test", "k1", "plan_resources")
    # the manifest does not exist: a stored profile must be used without reading data or training
    got, origin = ensure_profile(cfg, PLAN, 1, tmp_path / "no_manifest", tmp_path / "profiles", store, run)
    assert origin == "stored" and got == stored
    assert store.client.get_run(run).data.metrics["rap_capacity_ms.emb_fwd"] == 2.0
    with pytest.raises(FileNotFoundError, match="manifest"):  # another world size: it would profile, on no data
        ensure_profile(cfg, PLAN, 2, tmp_path / "no_manifest", tmp_path / "profiles", store, run)


def test_profile_job_measures_the_real_model_stores_logs_and_reuses(manifest_dir, recforge_home,  # noqa: F811 (fixture)
                                                                    tmp_path):
    from recforge.tracking import TrackingStore

    cfg = PipelineConfig(model=MODEL, train={"batch_size": 64}, seed=5)
    store = TrackingStore()
    run = store.stage_run("rap-test", "k2", "plan_resources")
    threads, had_group = torch.get_num_threads(), dist.is_initialized()
    torch.manual_seed(123)
    profile, origin = ensure_profile(cfg, PLAN, 1, manifest_dir, tmp_path / "profiles", store, run, dataset=DS)
    after = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(1))  # the profiling run left this process's RNG as it was
    assert torch.get_num_threads() == threads and dist.is_initialized() == had_group  # its group is gone
    assert origin == "profiled" and profile.threshold == CPU_THRESHOLD
    assert profile.key == ProfileKey.of(MODEL, PLAN.tables(), 1, 64, "cpu")
    assert all(profile.stage_ms[s] > 0 for s in STAGES)
    searched = profile.meta["slowdown_by_units"]
    # the steps really run: warmup, the profiler's warmup and baseline, per proxy size tried steps with and without
    assert profile.meta["paired"]
    assert profile.meta["steps"] == WARMUP + 1 + STEPS_PER_POINT * (1 + 2 * sum(len(v) for v in searched.values()))
    for s in STAGES:
        units = profile.capacity_units[s]
        assert all(v <= CPU_THRESHOLD for k, v in searched[s].items() if int(k) <= units)
        assert (profile.capacity_ms[s] > 0) == (units > 0)
    assert StageProfile.load(tmp_path / "profiles", profile.key) == profile
    arts = {a.path for a in store.client.list_artifacts(run, "rap")}  # the store's URI, not the env's
    assert {"rap/stage_profile.json", "rap/stage_profile.png"} <= arts
    assert store.client.get_run(run).data.params["rap_profile"] == profile.key.slug()
    again, origin = ensure_profile(cfg, PLAN, 1, manifest_dir, tmp_path / "profiles", store, run)
    assert origin == "stored" and again == profile


def test_a_failed_profiling_rank_ends_the_others_at_once():
    """recforge.rap.profiling.profile_ranks: the first rank to fail is reported without waiting for the ones it left
    blocked, and those are ended."""
    import subprocess
    import sys
    import time

    from recforge.rap.profiling.profile_ranks import _wait_all

    blocked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        assert _wait_all([blocked, failing], time.monotonic() + 100) == [(1, 3)]
        assert blocked.poll() is None  # reported while the blocked rank still runs: it did not wait for it
    finally:
        blocked.kill()
        blocked.wait()
    quick = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    assert _wait_all(quick, time.monotonic() + 100) == []
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert _wait_all([slow], time.monotonic() + 0.5) == [(0, "timeout")]
    finally:
        slow.kill()
        slow.wait()


# ------------------------------------------------------------------ CPU: the whole batch from the first stage


def _rap_like(compiled, predicted_ms: float):
    """A stand-in for RAP's schedule with the meta plan_schedule gives it (its predicted iteration time)."""
    from recforge.rap.planning.schedule import whole_kernel_schedule

    return whole_kernel_schedule(compiled, "allreduce", meta={
        "source": "RAP scheduler over stage profile x", "predicted_iteration_ms": predicted_ms, "unhidden_ms": 1.0,
        "simulated_iteration_ms": {"rap": predicted_ms, "ideal": sum(STAGE_MS.values())}})


def _capacity_profile(capacity: dict[str, float], device: str = "cpu") -> StageProfile:
    return StageProfile(key=ProfileKey.of(MODEL, PLAN.tables(), 1, 64, device), stage_ms=dict(STAGE_MS),
                        capacity_units={s: 1 for s in STAGES}, capacity_ms=dict(capacity), unit_ms=0.01,
                        threshold=0.1)


def test_a_cpus_co_run_thread_runs_the_whole_batch_from_the_first_stage_with_raps_schedule_recorded():
    from recforge.rap.planning.job_schedule import cpu_schedule

    compiled = compile_plan(PLAN)
    ideal = sum(STAGE_MS.values())
    # room in three stages (1 ms each): 2.5 ms started at emb_fwd runs on through mlp_fwd and mlp_bwd
    profile = _capacity_profile({"emb_fwd": 1.0, "mlp_fwd": 1.0, "mlp_bwd": 1.0, "emb_bwd": 0.0, "allreduce": 0.0})
    per_group = {g.name: nodes_cost(compiled, g) for g in compiled.groups}
    got = cpu_schedule(_rap_like(compiled, ideal + 1.0), compiled, profile, 2.5, per_group)
    assert {a.stage for a in got.assignments} == {"emb_fwd"}
    assert [a.group for a in got.assignments] == [g.name for g in compiled.groups]
    assert got.meta["predicted_iteration_ms"] == pytest.approx(ideal) and got.meta["unhidden_ms"] == 0.0
    assert got.meta["whole_start_iteration_ms"]["mlp_fwd"] == pytest.approx(ideal + 0.5)  # 2 ms of room from there
    assert got.meta["whole_start_iteration_ms"]["allreduce"] == pytest.approx(ideal + 2.5)  # none
    assert got.meta["rap_schedule_iteration_ms"] == ideal + 1.0 and got.meta["rap_schedule_unhidden_ms"] == 1.0
    assert got.meta["rap_schedule_stages"] == ["allreduce"]
    assert got.meta["cpu_schedule"].startswith("whole from emb_fwd") and "RAP scheduler" in got.meta["source"]
    assert got.meta["simulated_iteration_ms"]["ideal"] == ideal  # the simulator's numbers stay for MLflow
    # the groups' predictions are their shares of the whole batch, in proportion to their grouped times
    assert sum(a.predicted_ms for a in got.assignments) == pytest.approx(2.5)
    total = sum(per_group.values())
    assert got.assignments[0].predicted_ms == pytest.approx(per_group[compiled.groups[0].name] / total * 2.5)
    # more work than all the room: the excess is predicted unhidden
    over = cpu_schedule(_rap_like(compiled, ideal + 1.0), compiled, profile, 3.5, per_group)
    assert over.meta["unhidden_ms"] == pytest.approx(0.5)
    assert over.meta["predicted_iteration_ms"] == pytest.approx(ideal + 0.5)
    # the first stage is never predicted slower than a later start, whatever the capacities
    for caps in ({s: 0.0 for s in STAGES}, {s: 1e3 for s in STAGES}, {**{s: 0.0 for s in STAGES}, "allreduce": 9.0}):
        starts = cpu_schedule(_rap_like(compiled, ideal), compiled, _capacity_profile(caps), 2.5,
                              per_group).meta["whole_start_iteration_ms"]
        assert starts["emb_fwd"] == min(starts.values())


def test_plan_schedule_keeps_raps_schedule_on_a_gpu_profile_and_runs_the_whole_batch_on_a_cpu_one():
    capacity = {"emb_fwd": 0.0, "mlp_fwd": 0.0, "mlp_bwd": 0.0, "emb_bwd": 0.0, "allreduce": 1e3}
    gpu = plan_schedule(PLAN, DS, MODEL, world_size=1, batch_size=64, stage="emb_bwd", profile_dir=None,
                        profile=_capacity_profile(capacity, "cuda"))
    assert "cpu_schedule" not in gpu.meta and gpu.meta["source"].startswith("RAP scheduler")
    assert {a.stage for a in gpu.assignments} == {"allreduce"}  # RAP packs everything into the one stage with room
    cpu = plan_schedule(PLAN, DS, MODEL, world_size=1, batch_size=64, stage="emb_bwd", profile_dir=None,
                        profile=_capacity_profile(capacity, "cpu"))
    assert cpu.meta["cpu_schedule"].startswith("whole from emb_fwd")
    assert {a.stage for a in cpu.assignments} == {"emb_fwd"} and cpu.meta["rap_schedule_stages"] == ["allreduce"]
    # started at emb_fwd the batch runs on into the all-reduce window's room: nothing unhidden, as RAP's schedule
    assert cpu.meta["predicted_iteration_ms"] == pytest.approx(sum(STAGE_MS.values()), abs=1e-3)
    assert cpu.meta["rap_schedule_iteration_ms"] == pytest.approx(sum(STAGE_MS.values()), abs=1e-3)
