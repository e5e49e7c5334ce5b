"""RAP's unfused baseline as TorchScript (recforge.preprocess.fused_torch_script): every fused op's TorchScript
function gives the torch fallback's values (itself checked against the numpy oracle in test_kernels_fused), the
ScriptedFusedExecutor gives the C++ kernels' and the reference's outputs on every op and on list columns, runs no
native kernel, runs under RAP's co-run runtime, and plan_schedule times the executor it is given."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from every_op_plan import DS, EVERY_OP, f, outputs_equal
from recforge.config import ModelConfig
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors import record
from recforge.preprocess.fused_torch_script import OPS, ScriptedFusedExecutor, ScriptKernels, scripted
from recforge.preprocess.planning.plan import Plan
from recforge.preprocess.presets import PRESET_PLANS, load_plan, preset_dataset
from recforge.preprocess.semantics.reference import apply_plan_rows_ref
from recforge.preprocess.synth import random_raw_batch, reference_inputs
from recforge.rap.planning.job_schedule import plan_schedule
from recforge.rap.planning.schedule import whole_kernel_schedule
from recforge.rap.runtime.corun_runtime import CorunRuntime
from recforge_kernels import fused_torch
from recforge_kernels.reference import INT64_MAX, INT64_MIN

FAST = settings(max_examples=30, deadline=None)
floats32 = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.floats(0.0, 1.0, width=32),
                     st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-5, 16.0, float("nan"), float("inf"), float("-inf")]))
int64s = st.one_of(st.integers(INT64_MIN, INT64_MAX), st.integers(-100, 100),
                   st.sampled_from([0, 1, -1, INT64_MIN, INT64_MAX, 2**32 - 1, 2**53 + 1]))


def cols(dtype, elements):
    return st.lists(hnp.arrays(dtype, st.integers(0, 30), elements=elements), min_size=1, max_size=4)


def t(xs):
    return [torch.from_numpy(np.ascontiguousarray(x)) for x in xs]


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w) or (g.is_floating_point() and torch.equal(torch.isnan(g), torch.isnan(w))
                                     and torch.equal(g[~torch.isnan(g)], w[~torch.isnan(w)]))


@FAST
@given(xs=cols(np.int64, int64s), data=st.data())
def test_integer_ops_equal_the_torch_fallback(xs, data):
    n = len(xs)
    salts = data.draw(st.lists(st.sampled_from([0, 1, -7, INT64_MAX, INT64_MIN]), min_size=n, max_size=n))
    moduli = data.draw(st.lists(st.integers(1, INT64_MAX), min_size=n, max_size=n))
    same(scripted("sigrid_hash")(t(xs), salts, moduli), fused_torch.sigrid_hash(t(xs), salts, moduli))
    same(scripted("clamp_id")(t(xs), [-3] * n, [INT64_MAX] * n), fused_torch.clamp_id(t(xs), [-3] * n, [INT64_MAX] * n))
    table = torch.tensor(data.draw(st.lists(int64s, min_size=0, max_size=6 * n)), dtype=torch.int64)
    offsets = sorted(data.draw(st.lists(st.integers(0, table.numel()), min_size=n - 1, max_size=n - 1)))
    offsets = [0, *offsets, table.numel()]
    same(scripted("mapid")(t(xs), table, offsets), fused_torch.mapid(t(xs), table, offsets))
    same(scripted("cast_float")(t(xs)), fused_torch.cast(t(xs), True))
    valid = [torch.from_numpy(np.arange(len(x)) % 3 != 0) for x in xs]
    for dense in (True, False):
        same(scripted("fill_null")(t(xs), valid, [7.0] * n, dense), fused_torch.fill_null(t(xs), valid, [7.0] * n,
                                                                                           dense))


@FAST
@given(xs=cols(np.float32, floats32), lam=st.sampled_from([0.0, 1e-5, 0.5, -1.0, 3.0]), C=st.integers(1, 9))
def test_float_ops_equal_the_torch_fallback(xs, lam, C):
    n = len(xs)
    same(scripted("logit")(t(xs), [1e-3] * n, [1 - 1e-3] * n), fused_torch.logit(t(xs), [1e-3] * n, [1 - 1e-3] * n))
    same(scripted("log1p")(t(xs)), fused_torch.log1p(t(xs)))
    same(scripted("boxcox")(t(xs), [lam] * n), fused_torch.boxcox(t(xs), [lam] * n))
    same(scripted("clamp_float")(t(xs), [-1.5] * n, [0.75] * n), fused_torch.clamp_float(t(xs), [-1.5] * n, [0.75] * n))
    same(scripted("cast_id")(t(xs)), fused_torch.cast(t(xs), False))
    borders = torch.tensor([-1.0, 0.0, 0.5, 3.0, 1e3], dtype=torch.float32)
    offsets = [min(i, 5) for i in range(0, 2 * n + 1, 2)]
    offsets[-1] = 5
    same(scripted("bucketize")(t(xs), borders, offsets), fused_torch.bucketize(t(xs), borders, offsets))
    col = [x.unsqueeze(1) for x in t(xs)]
    keep = [C, 1, max(1, C - 2), C + 3][:n]
    same(ScriptKernels().fused_onehot(col, [-3.0] * n, [13.0] * n, [C] * n, keep),
         fused_torch.onehot(col, [-3.0] * n, [13.0] * n, [C] * n, keep))
    same(ScriptKernels().fused_onehot(col, [-3.0] * n, [13.0] * n, [C] * n),  # keep omitted: every class
         fused_torch.onehot(col, [-3.0] * n, [13.0] * n, [C] * n))


@FAST
@given(rows=st.lists(st.lists(int64s, max_size=7), max_size=12), x=hnp.arrays(
    np.int64, st.tuples(st.integers(0, 20), st.integers(1, 9)), elements=int64s), n=st.integers(1, 9))
def test_row_ops_equal_the_torch_fallback(rows, x, n):
    values = torch.tensor([v for r in rows for v in r], dtype=torch.int64)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    same(scripted("ngram_jagged")([values], [lengths], [n]), fused_torch.ngram_jagged([values], [lengths], [n]))
    same(scripted("firstx_jagged")([values], [lengths], [n]), fused_torch.firstx_jagged([values], [lengths], [n]))
    for arr in (x, x.astype(np.float32)):
        same(scripted("ngram")(t([arr]), [n]), fused_torch.ngram(t([arr]), [n]))
        same(scripted("firstx")(t([arr]), [n]), fused_torch.firstx(t([arr]), [n]))


def test_every_op_is_a_torchscript_function_and_unknown_ops_are_named():
    for op in OPS:
        assert isinstance(scripted(op), torch.jit.ScriptFunction), op  # runs in the interpreter, not in Python
    with pytest.raises(ValueError, match="no TorchScript fallback for op 'softmax'"):
        scripted("softmax")
    with pytest.raises(ValueError, match="'softmax'"):
        ScriptKernels().fused_softmax  # noqa: B018


@pytest.mark.parametrize("lists", [(), ("C1",), ("C1", "C2")])
@pytest.mark.parametrize("rows,seed", [(64, 1), (0, 2), (7, 3)])
def test_the_scripted_executor_equals_the_kernels_and_the_reference(lists, rows, seed):
    raw = random_raw_batch(DS, rows, seed=seed, list_columns=lists, extreme_rate=0.2)
    ex = ScriptedFusedExecutor(EVERY_OP, DS)
    before = record.mark()
    got = ex(raw)
    ran = record.since(before)
    assert ran["native"] == 0 and set(ran["batches"]) == {record.TORCH_FALLBACK}  # never the C++ kernels
    outputs_equal(got, make_executor("fused", EVERY_OP, DS, single_pass=False)(raw))
    outputs_equal(got, make_executor("fused", EVERY_OP, DS, native=False)(raw))
    expected = apply_plan_rows_ref(EVERY_OP, DS, *reference_inputs(raw))
    for n, _ in EVERY_OP.tables():
        want = np.concatenate(expected[n]) if expected[n] else np.zeros(0, np.int64)
        np.testing.assert_array_equal(got[1][n].values().numpy(), want, err_msg=n)
    assert ex.describe()["native"] is False
    assert ex.describe()["torchscript"] == "whole batch traced"


@pytest.mark.parametrize("rows", [64, 5])
def test_the_traced_whole_batch_equals_the_group_by_group_run(rows):
    """A batch without list columns runs as one traced graph (traced per row count); group by group gives the same
    outputs, and a batch with list columns takes the group-by-group path."""
    whole, per_group = ScriptedFusedExecutor(EVERY_OP, DS), ScriptedFusedExecutor(EVERY_OP, DS, whole_batch=False)
    assert whole.traces is not None and per_group.traces is None
    for seed in (1, 2):  # the second batch reuses the trace with other values
        raw = random_raw_batch(DS, rows, seed=seed, extreme_rate=0.2)
        inside = whole.traces.seconds
        got = whole(raw)
        assert whole.traces.seconds > inside  # ran the traced graph, from the first batch of this shape on
        assert per_group.describe()["torchscript"] == "per group"
        outputs_equal(got, per_group(raw))
        assert per_group.calls > 1 and whole.calls == per_group.calls  # the graph makes the same kernel calls
    assert whole.script_s > 0 and per_group.script_s > 0  # the time inside TorchScript calls is counted
    assert whole.traces.describe()["traced"] == 1 and whole.traces.describe()["kept"] == 1
    raw = random_raw_batch(DS, rows, seed=3, list_columns=("C1",))
    inside = whole.traces.seconds
    outputs_equal(whole(raw), make_executor("fused", EVERY_OP, DS)(raw))
    assert whole.traces.seconds == inside and whole.traces.traced == 1  # list columns: group by group


@pytest.mark.parametrize("name", PRESET_PLANS)
def test_the_scripted_executor_equals_the_kernels_on_the_presets(name):
    ds = preset_dataset(name)
    plan = load_plan(name, ds)
    raw = random_raw_batch(ds, 48, seed=5)
    outputs_equal(ScriptedFusedExecutor(plan, ds)(raw), make_executor("fused", plan, ds)(raw))


def test_the_co_run_runtime_runs_the_scripted_groups_spread_over_stages():
    ex = ScriptedFusedExecutor(EVERY_OP, DS)
    sched = whole_kernel_schedule(ex.compiled, "emb_fwd")
    last = sched.assignments[-1]
    sched.assignments[-1] = type(last)("allreduce", last.group, last.features, last.predicted_ms)
    raw = random_raw_batch(DS, 40, seed=6, list_columns=("C1",))
    runtime = CorunRuntime(ex, sched, "cpu", threads=1)
    try:
        got = runtime.launch(raw).result()
    finally:
        runtime.close()
    outputs_equal(got, make_executor("fused", EVERY_OP, DS)(raw))
    assert ex.executed.snapshot()["native"] == 0


def test_plan_schedule_times_the_executor_it_is_given():
    model = ModelConfig(arch="dlrm_dcn", embedding_dim=4, dense_arch=[8, 4], over_arch=[8, 1])
    ex = ScriptedFusedExecutor(EVERY_OP, DS)
    sched = plan_schedule(EVERY_OP, DS, model, 1, 32, "emb_bwd", None, executor=ex)
    assert {a.group for a in sched.assignments} == {g.name for g in ex.compiled.groups}
    assert ex.executed.snapshot()["group_calls"]  # its groups were the ones timed
    other = Plan.model_validate({"name": "other", "features": [f("I1", "dense", "I1", ("fill_null", {}))]})
    with pytest.raises(ValueError, match="executor runs plan 'every_op', not 'other'"):
        plan_schedule(other, DS, model, 1, 32, "emb_bwd", None, executor=ex)
