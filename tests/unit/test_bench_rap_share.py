"""bench/bench_rap_share.py's logic (candidates, the choice of points by share, refusal of what the machine cannot
hold, RAP's prediction fields, the plot) and what it needed in rap/: a job whose groups all run whole in one stage
runs there as one executor call (the single pass), and kernel costs scaled to the whole batch's time."""
from __future__ import annotations

import os
import time

import pytest
import torch

from recforge.config import DatasetConfig, DenseFeature, SparseFeature
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors import record
from recforge.preprocess.planning.plan import criteo_plan
from recforge.preprocess.synth import random_raw_batch
from recforge.rap.planning.job_schedule import batch_scaled
from recforge.rap.planning.schedule import whole_kernel_schedule
from recforge.rap.profiling.profile_job import single_rank_group
from recforge.rap.runtime.corun_runtime import CorunRuntime

DS = DatasetConfig(
    name="rap_share_tiny",
    dense=[DenseFeature(name=f"I{i}", missing_rate=0.2) for i in range(1, 4)],
    sparse=[SparseFeature(name=f"C{i}", cardinality=c, missing_rate=0.1) for i, c in enumerate([50, 300, 7], 1)],
)
PLAN = criteo_plan(DS, table_cap=64)


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("rap_share")


def test_candidates_are_the_grid_and_bad_names_are_refused(bench):
    got = bench.parse_candidates("plan0,plan2", "tiny,micro", "512,2048", "single,grouped")
    assert len(got) == 16 and got[0] == bench.Candidate("plan0", "tiny", 512, "single")
    assert got[-1].name == "plan2/micro/b2048/grouped"
    with pytest.raises(ValueError, match=r"unknown model size\(s\) \['huge'\]"):
        bench.parse_candidates("plan0", "huge", "512")
    with pytest.raises(ValueError, match="--forms"):
        bench.parse_candidates("plan0", "tiny", "512", "unfused")
    with pytest.raises(ValueError, match="positive batch"):
        bench.parse_candidates("plan0", "tiny", "0")


def test_points_are_the_closest_shares_each_used_once(bench):
    c = [bench.Candidate("plan0", m, 512) for m in ("small", "tiny", "micro")]
    shares = {c[0]: 0.02, c[1]: 0.2, c[2]: 0.45}
    got = bench.choose_points(shares, [0.03, 0.28, 0.5])
    assert got == [(0.03, c[0]), (0.28, c[1]), (0.5, c[2])]
    # two targets nearest the same candidate: the second gets the next closest (log space: 0.2 is nearer 0.05
    # than 0.02 is: |log 4| < |log 2.5| is false, so 0.02 first, then 0.2)
    assert bench.choose_points(shares, [0.05, 0.06]) == [(0.05, c[0]), (0.06, c[1])]
    assert len(bench.choose_points({c[0]: 0.1}, [0.1, 0.5])) == 1  # fewer candidates than targets
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        bench.choose_points(shares, [0.3, 1.5])


def test_a_configuration_beyond_the_machine_is_refused_before_it_runs(bench):
    small = [bench.Candidate("plan0", "micro", 256)]
    bench.check_machine(small, 1, 1 if (os.cpu_count() or 1) > 1 else 0, 256 * 4)  # fits: no error
    cores = os.cpu_count() or 1
    with pytest.raises(SystemExit, match=rf"os.cpu_count\(\) = {cores} cores"):
        bench.check_machine(small, cores, 1, 256)
    with pytest.raises(SystemExit, match=r"psutil.virtual_memory\(\).available"):
        bench.check_machine(small, 1, 0, 10**13)  # 10^13 rows held in memory


def test_rap_prediction_fields_of_a_small_point(bench):
    point_c = bench.Candidate("plan0", "micro", 64, "grouped")
    before = torch.get_num_threads()
    with single_rank_group():
        point = bench.Point(point_c, seed=0)
        sched, pred = bench.predict(point, threads=1, corun_threads=1, steps_per_point=1, threshold=0.1)
    assert torch.get_num_threads() == before
    assert {a.group for a in sched.assignments} == {g.name for g in point.executor.compiled.groups}
    # hidden or serialized, never below training (the simulator's iteration times are rounded to 4 decimals)
    assert pred["corun_step_ms"] >= pred["ideal_step_ms"] - 1e-4
    assert pred["inline_step_ms"] == pytest.approx(pred["ideal_step_ms"] + pred["inline_preprocess_ms"])
    assert 0.0 <= pred["hidden_fraction"] <= 1.0
    assert pred["corun_vs_ideal"] == pytest.approx(pred["ideal_step_ms"] / pred["corun_step_ms"])
    assert set(pred["stage_ms"]) == set(pred["capacity_ms"]) == {"emb_fwd", "mlp_fwd", "mlp_bwd", "emb_bwd",
                                                                  "allreduce"}


def test_plot_writes_the_png(bench, tmp_path):
    def pt(name, share, ratio):
        m = {"corun_vs_ideal": ratio, "corun_vs_inline": 1.1, "inline_vs_ideal": 0.8, "corun_early_vs_ideal": 0.9,
             "corun_early_vs_inline": 1.2}
        return {"name": name, "share": share, "measured": m,
                "predicted": {"corun_vs_ideal": 0.95, "corun_vs_inline": 1.2, "corun_early_vs_inline": 1.3}}

    out = tmp_path / "rap_share.png"
    bench.plot([pt("b", 0.3, 0.85), pt("a", 0.03, 0.97)], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_job_whole_in_one_stage_runs_as_one_single_pass_call():
    executor = make_executor("fused", PLAN, DS)
    raw = random_raw_batch(DS, 40, seed=3)
    want_dense, want_kjt = make_executor("fused", PLAN, DS)(raw)
    runtime = CorunRuntime(executor, whole_kernel_schedule(executor.compiled, "emb_fwd"), "cpu", threads=1)
    try:
        assert runtime.whole_stage == ("emb_fwd",)
        before = record.mark()
        dense, kjt = runtime.launch(raw).result()
        got = record.since(before)
    finally:
        runtime.close()
    assert torch.equal(dense, want_dense) and torch.equal(kjt.values(), want_kjt.values())
    assert torch.equal(kjt.lengths(), want_kjt.lengths()) and kjt.keys() == want_kjt.keys()
    assert got["batches"] == {"cpp_single_pass": 1} and not got["group_calls"]
    assert runtime.cycles[0].run_ms.keys() == {"emb_fwd"}


def test_a_job_spread_over_stages_runs_group_by_group():
    executor = make_executor("fused", PLAN, DS)
    sched = whole_kernel_schedule(executor.compiled, "emb_fwd")
    last = sched.assignments[-1]  # the last group (nothing after it reads it) moves to a later stage
    sched.assignments[-1] = type(last)("allreduce", last.group, last.features, last.predicted_ms)
    runtime = CorunRuntime(executor, sched, "cpu", threads=1)
    try:
        assert runtime.whole_stage == (None,)
        raw = random_raw_batch(DS, 40, seed=4)
        dense, _ = runtime.launch(raw).result()
    finally:
        runtime.close()
    assert torch.equal(dense, make_executor("fused", PLAN, DS)(raw)[0])


def test_kernel_costs_are_scaled_up_to_the_whole_batch_never_down():
    compiled = make_executor("fused", PLAN, DS).compiled
    per = {g.nodes: 0.5 + i for i, g in enumerate(compiled.groups)}
    total = sum(per.values())
    up = batch_scaled(lambda g: per[g.nodes], compiled, 3 * total)
    assert sum(up(g) for g in compiled.groups) == pytest.approx(3 * total)
    same = batch_scaled(lambda g: per[g.nodes], compiled, total / 2)
    assert [same(g) for g in compiled.groups] == [per[g.nodes] for g in compiled.groups]


def test_the_torch_form_runs_the_same_groups_on_torch_ops_with_the_same_values(bench):
    """The unfused baseline form ("torch": FusedExecutor(native=False)) never calls the C++ kernels, and gives the
    values of the native forms on the same batch."""
    assert bench.executor_options("torch") == {"single_pass": False, "native": False, "trace_batches": True}
    assert bench.executor_options("single") == {"single_pass": True, "native": True, "trace_batches": True}
    assert bench.executor_options("grouped_python") == {"single_pass": False, "native": True, "trace_batches": False}
    with pytest.raises(ValueError, match="unknown executor form 'unfused'"):
        bench.executor_options("unfused")
    raw = random_raw_batch(DS, 256, seed=5)
    executors = {f: bench.build_executor(f, PLAN, DS) for f in bench.FORMS}
    outs = {f: executors[f](raw) for f in bench.FORMS}
    outs["grouped_traced"] = executors["grouped"](raw)  # the second batch of this shape: traced
    assert executors["grouped"].traces.traced == 1 and executors["grouped_python"].traces is None
    for f in ("grouped", "grouped_traced", "grouped_python", "torch", "script"):
        assert torch.equal(outs[f][0], outs["single"][0]), f
        for key in outs["single"][1].keys():
            assert torch.equal(outs[f][1][key].values(), outs["single"][1][key].values()), (f, key)


def test_the_script_form_is_the_torch_fallback_as_torchscript(bench):
    """"script": the torch form's groups, each one TorchScript call (no single pass, no native kernel), sharing the
    compiled plan it is given; the share of its time inside TorchScript is measured for it alone."""
    torch_ex = bench.build_executor("torch", PLAN, DS)
    ex = bench.build_executor("script", PLAN, DS, torch_ex.compiled)
    assert type(ex).__name__ == "ScriptedFusedExecutor" and ex.compiled is torch_ex.compiled
    assert bench.executor_options("script") == {"single_pass": False, "native": False, "trace_batches": True}
    raw = random_raw_batch(DS, 64, seed=6)
    ex(raw)
    assert ex.last_path == record.TORCH_FALLBACK and ex.executed.snapshot()["native"] == 0
    with pytest.raises(ValueError, match="unknown executor form 'jit'"):
        bench.build_executor("jit", PLAN, DS)
    with single_rank_group():
        share = bench.torchscript_share(bench.Point(bench.Candidate("plan0", "micro", 64, "script"), seed=0), reps=2)
        assert bench.torchscript_share(bench.Point(bench.Candidate("plan0", "micro", 64, "torch"), seed=0)) is None
        grouped = bench.torchscript_share(bench.Point(bench.Candidate("plan2", "micro", 64, "grouped"), seed=0),
                                          reps=2)
        assert bench.torchscript_share(bench.Point(bench.Candidate("plan2", "micro", 64, "grouped_python"),
                                                   seed=0)) is None
    assert share is not None and 0 < share <= 1
    assert grouped is not None and 0 < grouped <= 1  # the C++ groups' traced graph


def test_the_pair_check_times_both_threads(bench, load_bench):
    """bench_rap_pair: the step and the executor, alone and beside each other (a small point, both sides timed)."""
    pair_mod = load_bench("rap_pair")
    with single_rank_group():
        r = pair_mod.pair(bench.Candidate("plan0", "micro", 64, "script"), steps=2)
    assert set(r) >= {"step_alone_ms", "step_beside_executor_ms", "executor_alone_ms", "executor_beside_steps_ms"}
    assert all(v > 0 for v in r.values())
    assert r["step_slowdown"] == pytest.approx(r["step_beside_executor_ms"] / r["step_alone_ms"])


def test_the_step_clock_keeps_each_step_and_the_steady_state_leaves_out_each_epochs_first(bench, monkeypatch):
    now = [1000.0]  # the clock the marks read: advanced by the test only, so a busy machine cannot move it
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    clocks = []
    for first in (50.0, 70.0):  # two epochs: a slow first step (the co-run's fill), then 3 steady ones
        clock = bench.StepClock()
        for ms in (first, 10.0, 12.0, 11.0):
            now[0] += ms / 2e3  # half the step in data, half in forward, then coordination ends the step
            clock.mark("data")
            now[0] += ms / 2e3
            clock.mark("forward")
            clock.mark("coordination")
        assert len(clock.steps_ms) == 4 and clock.steps == 0  # PhaseTimes' own counter is the loop's to advance
        assert sum(clock.steps_ms[0].values()) == pytest.approx(first, abs=1e-6)
        clocks.append(clock)
    assert bench.steady_ms(clocks) == pytest.approx(11.0, abs=1e-6)  # median of 10, 12, 11, 10, 12, 11
    phases = bench.phase_ms(clocks)
    assert phases["data"] == pytest.approx(5.5, abs=1e-3) and phases["forward"] == pytest.approx(5.5, abs=1e-3)
    assert phases["backward"] == 0.0
    one = bench.StepClock()
    one.mark("coordination")
    with pytest.raises(ValueError, match="more than one step"):
        bench.steady_ms([one])
