"""The fused executor's traced whole batch (recforge.preprocess.executors.batch_trace): a batch shape is traced the
second time it is seen, the graph gives the per-group path's outputs bit for bit on every op, calls the C++ kernels
(no Python op but `finish`'s stack_columns), is kept per shape up to its capacity, is never used for list columns, and
what ran is recorded."""
from __future__ import annotations

import dataclasses

import pytest

from every_op_plan import DS, EVERY_OP, outputs_equal
from recforge.config import DatasetConfig
from recforge.preprocess.columns import BatchError
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors import record
from recforge.preprocess.executors.batch_trace import BatchTraces
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.planning.plan import Plan
from recforge.preprocess.presets import PRESET_PLANS, load_plan, preset_dataset
from recforge.preprocess.synth import random_raw_batch


def grouped(plan: Plan, ds: DatasetConfig, **options) -> FusedExecutor:
    ex = make_executor("fused", plan, ds, single_pass=False, **options)
    assert isinstance(ex, FusedExecutor)
    return ex


@pytest.mark.parametrize("rows", [1, 3, 64, 257])
def test_the_traced_batch_equals_the_per_group_run(rows):
    traced, per_group = grouped(EVERY_OP, DS), grouped(EVERY_OP, DS, trace_batches=False)
    assert traced.traces is not None and per_group.traces is None
    for seed in range(4):  # traced at the second batch of this shape; later batches reuse it with other values
        raw = random_raw_batch(DS, rows, seed=seed, extreme_rate=0.2)
        got = traced(raw)
        assert traced.traces.traced == (0 if seed == 0 else 1)
        outputs_equal(got, per_group(raw))
        assert traced.calls == per_group.calls > 1  # the graph makes the per-group path's kernel calls
    assert traced.traces.seconds > 0
    assert traced.describe()["batch_traces"] == {"traced": 1, "kept": 1, "after": 2, "capacity": 4}
    assert per_group.describe()["batch_traces"] == "off"


@pytest.mark.parametrize("name", PRESET_PLANS)
def test_the_traced_batch_equals_the_single_pass_on_the_presets(name):
    ds = preset_dataset(name)
    plan = load_plan(name, ds)
    traced, single = grouped(plan, ds), make_executor("fused", plan, ds)
    for seed in (1, 2, 3):
        raw = random_raw_batch(ds, 96, seed=seed, extreme_rate=0.1)
        outputs_equal(traced(raw), single(raw))
    assert traced.traces is not None and traced.traces.traced == 1


def test_the_graph_calls_the_cpp_kernels_and_no_python_but_stack_columns():
    ex = grouped(EVERY_OP, DS)
    raw = random_raw_batch(DS, 32, seed=1)
    ex(raw)
    ex(raw)
    assert ex.traces is not None
    (graph,) = ex.traces._graphs.values()
    kinds = {n.kind() for n in graph.graph.nodes()}
    assert {"recforge_cpu::sigrid_hash", "recforge_cpu::logit", "recforge_cpu::boxcox", "recforge_cpu::onehot",
            "recforge_cpu::bucketize", "recforge_cpu::mapid", "recforge_cpu::fill_null_columns"} <= kinds
    assert not any(k.startswith("prim::Python") for k in kinds)
    assert {k for k in kinds if k.startswith("recforge::")} == {"recforge::stack_columns"}  # finish's dense matrix


def test_a_batch_with_list_columns_runs_group_by_group():
    ex = grouped(EVERY_OP, DS)
    raw = random_raw_batch(DS, 40, seed=4, list_columns=("C1",))
    for _ in range(3):
        outputs_equal(ex(raw), grouped(EVERY_OP, DS, trace_batches=False)(raw))
    assert ex.traces is not None and ex.traces.traced == 0 and ex.traces.seconds == 0


def test_shapes_are_kept_up_to_the_capacity_least_recently_used_out():
    ex = grouped(EVERY_OP, DS)
    assert ex.traces is not None
    for rows in (5, 6, 7, 8, 9):
        raw = random_raw_batch(DS, rows, seed=rows)
        ex(raw)
        ex(raw)
    assert ex.traces.traced == 5 and ex.traces.describe()["kept"] == 4
    assert [k[0] for k in ex.traces._graphs] == [6, 7, 8, 9]
    raw = random_raw_batch(DS, 5, seed=11)  # evicted: seen twice again before it is traced again
    ex(raw)
    assert ex.traces.traced == 6  # its sightings were kept, so this one traces it


def test_what_ran_is_recorded():
    ex = grouped(EVERY_OP, DS)
    raw = random_raw_batch(DS, 16, seed=2)
    before = record.mark()
    for _ in range(3):
        ex(raw)
    got = record.summarize("fused", record.since(before))
    assert got["path"] == "cpp_per_group" and got["native_kernels"] is True
    assert got["detail"]["reasons"]["cpp_per_group"] == (
        "whole batch traced: one TorchScript call; single pass off (single_pass=False) (x2) | "
        "single pass off (single_pass=False) (x1)")


def test_a_traced_executor_still_checks_every_batch():
    ex = grouped(EVERY_OP, DS)
    raw = random_raw_batch(DS, 16, seed=2)
    ex(raw)
    ex(raw)
    good = random_raw_batch(DS, 16, seed=3)
    bad = dataclasses.replace(good, sparse=good.sparse[:, :2])  # a column short
    with pytest.raises(BatchError):
        ex(bad)


@pytest.mark.parametrize("after,capacity", [(0, 4), (2, 0)])
def test_bad_settings_are_refused(after, capacity):
    with pytest.raises(ValueError, match="after and capacity"):
        BatchTraces(lambda raw: raw, after=after, capacity=capacity)  # type: ignore[arg-type,return-value]
