"""Stage profiler: the capacity search against a linear scan, a real (tiny) profiling run on the DLRM with the
proxy on its background thread, profile keys / mismatches, JSON, MLflow."""
from __future__ import annotations

import json
import statistics
import threading

import pytest
import torch

from recforge.config import ModelConfig
from recforge.rap.profiling.profiler import (
    BackgroundRunner,
    ProfileKey,
    ProfileMismatch,
    ProxyKernel,
    StageProfile,
    StageProfiler,
    capacity_ms_from_units,
    find_capacity,
    log_profile,
)
from recforge.rap.profiling.stages import STAGES, StageTracker
from test_rap_stages import TABLES, _batch, _model


@pytest.mark.parametrize("edge", [0, 1, 2, 3, 7, 8, 12, 31, 32])
@pytest.mark.parametrize("max_units", [1, 8, 32])
def test_find_capacity_equals_linear_scan(edge, max_units):
    calls = []

    def slowdown(k):
        calls.append(k)
        return 0.0 if k <= edge else 0.5

    want = max((k for k in range(0, max_units + 1) if k <= edge), default=0)
    assert find_capacity(slowdown, 0.02, max_units) == want
    assert len(calls) <= 2 * max_units.bit_length() + 2  # logarithmic, not a scan


def test_background_runner_has_its_own_thread_budget():
    before = torch.get_num_threads()
    runner = BackgroundRunner(threads=1)
    seen = runner.submit(lambda: (torch.get_num_threads(), threading.current_thread().name)).result()
    runner.close()
    assert seen[0] == 1 and seen[1] != threading.current_thread().name
    assert torch.get_num_threads() == before


def test_proxy_matches_its_definition():
    proxy = ProxyKernel(rows=16, max_units=2)
    from recforge_kernels import fused

    outs = fused.fused_ngram(proxy._xs[:4], [4] * 4)
    assert all(o.shape == (16, 20) for o in outs)  # RAP's proxy width
    proxy(2)
    with pytest.raises(ValueError, match="at most 2"):
        proxy(3)
    assert proxy.standalone_ms(0) == 0.0 and proxy.standalone_ms(1) > 0


def _key(world=1, batch=16, device="cpu", cfg=None):
    cfg = cfg or ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1])
    return ProfileKey.of(cfg, TABLES, world, batch, device)


def _tracked_training():
    """(tracker, step): the tiny DLRM under a StageTracker and one full training step of it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracker = StageTracker(model)
    seeds = iter(range(10_000))

    def step():
        dense, kjt, labels = _batch(next(seeds))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).reshape(-1), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        tracker.step_end()

    return tracker, step


@pytest.fixture(scope="module")
def profile():
    tracker, step = _tracked_training()

    runner = BackgroundRunner(threads=1)
    try:
        prof = StageProfiler(tracker, step, ProxyKernel(rows=64, max_units=4), runner, steps_per_point=3,
                             warmup=1).run(_key(), threshold=0.02, max_units=4)
    finally:
        runner.close()
        tracker.detach()
    return prof


def test_real_profile_has_every_stage(profile):
    assert set(profile.stage_ms) == set(STAGES) and all(v > 0 for v in profile.stage_ms.values())
    for s in STAGES:
        assert 0 <= profile.capacity_units[s] <= 4
        assert (profile.capacity_ms[s] > 0) == (profile.capacity_units[s] > 0)
        tried = profile.meta["slowdown_by_units"][s]
        assert "1" in tried  # the search measured at least one proxy size in every stage
        within = [int(k) for k, v in tried.items() if v <= 0.02]
        assert profile.capacity_units[s] >= max(within, default=0) or profile.capacity_units[s] == 4


def test_profile_json_round_trip_save_load_and_mismatch(profile, tmp_path):
    assert StageProfile.from_json(profile.to_json()) == profile
    path = profile.save(tmp_path)
    assert path.name == f"{profile.key.slug()}.json"
    assert StageProfile.load(tmp_path, _key()) == profile
    with pytest.raises(ProfileMismatch, match=r"world_size 1 \(the job has 2\)"):
        profile.check(_key(world=2))
    with pytest.raises(ProfileMismatch, match="model config / tables"):
        profile.check(_key(cfg=ModelConfig(embedding_dim=8, dense_arch=[32, 8], over_arch=[16, 1])))
    with pytest.raises(ProfileMismatch, match="no stage profile"):
        StageProfile.load(tmp_path, _key(batch=32))
    bad = json.loads(profile.to_json())
    del bad["capacity_ms"]["allreduce"]
    with pytest.raises(ProfileMismatch, match="allreduce"):
        StageProfile.from_json(json.dumps(bad))


def test_profile_logged_to_mlflow(profile, recforge_home):
    from recforge.tracking import TrackingStore

    store = TrackingStore()
    run = store.stage_run("rap-test", "k1", "profile")
    log_profile(profile, store, run)
    data = store.client.get_run(run).data
    assert data.metrics["rap_stage_ms.allreduce"] == pytest.approx(profile.stage_ms["allreduce"])
    local = store.client.download_artifacts(run, "rap/stage_profile.json", str(recforge_home))
    assert StageProfile.from_json(open(local).read()) == profile
    # the schedule and its Gantt chart go to the same run
    from recforge.preprocess.planning.compiler import compile_plan
    from recforge.preprocess.presets import load_plan
    from recforge.rap.planning.gantt import log_schedule
    from recforge.rap.planning.schedule import CorunSchedule, whole_kernel_schedule

    sched = whole_kernel_schedule(compile_plan(load_plan("plan0"), method="greedy"), "allreduce")
    log_schedule(sched, profile.stage_ms, profile.capacity_ms, store, run)
    names = {a.path for a in store.client.list_artifacts(run, "rap")}
    assert {"rap/schedule.json", "rap/schedule.png", "rap/stage_profile.json"} <= names
    back = store.client.download_artifacts(run, "rap/schedule.json", str(recforge_home))
    assert CorunSchedule.from_json(open(back).read()) == sched


def test_capacity_units_to_ms():
    assert capacity_ms_from_units({"a": 0, "b": 3}, lambda u: 0.5 + u) == {"a": 0.0, "b": 3.5}


def test_paired_search_measures_each_size_against_interleaved_steps():
    tracker, step = _tracked_training()
    runner = BackgroundRunner(threads=1)
    launched = []
    proxy = ProxyKernel(rows=16, max_units=2)
    try:
        profiler = StageProfiler(tracker, step, proxy, runner, steps_per_point=2, warmup=0, paired=True)
        real_call = proxy.__call__
        profiler.proxy = lambda units: (launched.append(units), real_call(units))
        before = len(tracker.steps)
        slowdown = profiler.paired_slowdown("mlp_bwd", 2)
        assert len(tracker.steps) - before == 4  # 2 with the proxy, 2 without, alternating
        assert launched == [2, 2]  # only in the steps with the proxy
        with_p = [t.ms["mlp_bwd"] for t in tracker.steps[before + 1::2]]
        without = [t.ms["mlp_bwd"] for t in tracker.steps[before::2]]
        assert slowdown == pytest.approx(statistics.median(with_p) / statistics.median(without) - 1.0)
    finally:
        runner.close()
        tracker.detach()
