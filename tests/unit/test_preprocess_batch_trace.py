"""The fused executor's traced whole batch (recforge.preprocess.executors.batch_trace): a batch shape is traced the
second time it is seen, the graph gives the per-group path's outputs bit for bit on every op, calls the C++ kernels
(no Python op but `finish`'s stack_columns), is kept per shape up to its capacity, is never used for list columns, and
what ran is recorded."""
from __future__ import annotations

import dataclasses
import linecache
import threading
import warnings
from pathlib import Path

import pytest
import torch

from every_op_plan import DS, EVERY_OP, outputs_equal
from recforge.config import DatasetConfig, DenseFeature
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.columns import BatchError
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors import record
from recforge.preprocess.executors.batch_trace import BatchTraces
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.planning.plan import Plan
from recforge.preprocess.presets import PRESET_PLANS, load_plan, preset_dataset
from recforge.preprocess.synth import random_raw_batch
from recforge_kernels import fused as fused_ops


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
    outputs_equal(ex(raw), grouped(EVERY_OP, DS, trace_batches=False)(raw))
    assert ex.traces.traced == 5
    ex(raw)
    assert ex.traces.traced == 6 and [k[0] for k in ex.traces._graphs] == [7, 8, 9, 5]


def test_rotating_shapes_stop_tracing_at_the_budget():
    """More shapes in rotation than kept: after `budget` traces no new shape is traced, so rotation cannot make every
    batch pay for a trace; the batches still give the per-group path's values."""
    ex, ref = grouped(EVERY_OP, DS), grouped(EVERY_OP, DS, trace_batches=False)
    ex.traces = BatchTraces(ex._grouped_outputs, capacity=2, budget=3)
    for _ in range(4):
        for rows in (3, 4, 5):
            raw = random_raw_batch(DS, rows, seed=rows)
            outputs_equal(ex(raw), ref(raw))
    assert ex.traces.traced == 3
    assert ex.traces.describe()["stopped"] == "3 shapes traced: the budget of 3; new shapes run group by group"


def test_a_failed_trace_falls_back_to_the_groups_once_and_for_all(monkeypatch, caplog):
    ex, ref = grouped(EVERY_OP, DS), grouped(EVERY_OP, DS, trace_batches=False)
    tries = []

    def broken(*args, **kwargs):
        tries.append(1)
        raise RuntimeError("tracer broke")

    monkeypatch.setattr(torch.jit, "trace", broken)
    raw = random_raw_batch(DS, 12, seed=3)
    for _ in range(4):
        outputs_equal(ex(raw), ref(raw))
    assert ex.traces is not None and len(tries) == 1 and ex.traces.traced == 0
    assert ex.traces.describe()["failed"] == ["RuntimeError: tracer broke"]
    assert "batch trace failed for rows=12" in caplog.text


def test_switching_the_cpu_backend_traces_the_fallback_apart():
    """The kernel path is part of a trace's key: after set_cpu_backend('torch') the batch is traced again on the
    torch ops and recorded as torch_fallback, never run on the C++ graph."""
    ex = grouped(EVERY_OP, DS)
    raw = random_raw_batch(DS, 20, seed=2)
    ex(raw)
    ex(raw)
    fused_ops.set_cpu_backend("torch")
    try:
        for _ in range(3):
            got = ex(raw)
        assert ex.last_path == record.TORCH_FALLBACK
    finally:
        fused_ops.set_cpu_backend("cpp")
    outputs_equal(got, grouped(EVERY_OP, DS, trace_batches=False)(raw))
    assert ex.traces is not None and ex.traces.traced == 2
    cpp_graph, torch_graph = ex.traces._graphs.values()
    assert any(n.kind().startswith("recforge_cpu::") for n in cpp_graph.graph.nodes())
    assert not any(n.kind().startswith("recforge_cpu::") for n in torch_graph.graph.nodes())


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
    bad = dataclasses.replace(good, sparse_valid=good.sparse_valid[:, :2])  # the same trace key, a flag column short
    assert BatchTraces.key(bad, "x") == BatchTraces.key(raw, "x")
    with pytest.raises(BatchError):
        ex(bad)


def test_float_dense_and_strided_batches_equal_the_per_group_run():
    """A float64 dense matrix (a float dense column), and batches that are row slices or strided rows of a larger
    buffer, through the same traced graph as contiguous batches of their shape."""
    ds = DatasetConfig(name="trace_float", dense=[*DS.dense[:2], DenseFeature(name="I3", dtype="float")],
                       sparse=DS.sparse)
    traced, ref = grouped(EVERY_OP, ds), grouped(EVERY_OP, ds, trace_batches=False)
    big = random_raw_batch(ds, 90, seed=7, extreme_rate=0.2)
    assert big.dense.dtype == torch.float64

    def rows(sl) -> RawBatch:
        return dataclasses.replace(big, label=big.label[sl], dense=big.dense[sl], dense_valid=big.dense_valid[sl],
                                   sparse=big.sparse[sl], sparse_valid=big.sparse_valid[sl])

    for batch in (rows(slice(0, 30)), rows(slice(30, 60)), rows(slice(0, 90, 3)), rows(slice(60, 90))):
        outputs_equal(traced(batch), ref(batch))
    assert traced.traces is not None and traced.traces.traced == 1 and traced.traces.seconds > 0


def test_two_threads_share_one_executor():
    """The co-run thread and the trainer may call one executor: traced calls from both give the per-group values,
    and each thread's `calls` counts its own batch."""
    ex, ref = grouped(EVERY_OP, DS), grouped(EVERY_OP, DS, trace_batches=False)
    raws = [random_raw_batch(DS, 24, seed=s) for s in range(6)]
    want = [ref(r) for r in raws]
    errors: list[BaseException] = []
    calls: list[int] = []

    def work() -> None:
        try:
            for _ in range(5):
                for r, w in zip(raws, want, strict=True):
                    outputs_equal(ex(r), w)
                    calls.append(ex.calls)
        except BaseException as e:  # noqa: BLE001 (reported to the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(calls) == 60 and set(calls) == {ref.calls}
    assert ex.traces is not None and ex.traces.traced == 1


# where torch's tracer warns while tracing the groups: shapes and parameters only (constants of a trace made per
# shape). A new warning elsewhere may be Python that reads tensor values, which a trace would freeze: look at it.
KNOWN_TRACER_WARNINGS = {
    ("batch.py", "return int(self.label.shape[0])"),
    ("columns.py", "widths = torch.tensor([c.values.shape[1] for c in cols], dtype=torch.int32, device=device)"),
    ("fused.py", "return torch.tensor([v for x in lists for v in x], dtype=dtype), offsets"),
    ("fused.py", "if c.jagged or c.values.shape[1] != 1:"),
    ("fused.py", "if op == \"firstx\" or k >= w:"),
    ("fused_torch.py", "if t.numel() == 0:"),
    ("fused_torch.py", "fill_t = torch.tensor(fill if dense else int(fill), dtype=dtype, device=x.device)"),
    ("fused_torch.py", "l32, h32 = torch.tensor(lo_f, dtype=torch.float32), torch.tensor(hi_f, dtype=torch.float32)"),
    ("fused_torch.py", "lam = float(torch.tensor(lam, dtype=torch.float32))"),
    ("ops.py", "return float(torch.tensor(eps, dtype=torch.float32)), "
               "float(torch.tensor(1.0 - eps, dtype=torch.float32))"),
    ("jagged_tensor.py", "assert pt2_guard_or_false(tensor.numel() == 0) or tensor.dtype in ["),
}


@pytest.mark.parametrize("native", [True, False])
def test_the_tracer_warns_only_about_shapes_and_parameters(native):
    seen = set()
    for plan, ds in [(EVERY_OP, DS)] + [(load_plan(n, preset_dataset(n)), preset_dataset(n)) for n in PRESET_PLANS]:
        ex = grouped(plan, ds, native=native)
        raw = random_raw_batch(ds, 16, seed=1)

        def body(dense, dense_valid, sparse, sparse_valid, ex=ex, label=raw.label):
            return ex._grouped_outputs(RawBatch(label=label, dense=dense, dense_valid=dense_valid, sparse=sparse,
                                                sparse_valid=sparse_valid))

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.jit.trace(body, (raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid), check_trace=False)
        for w in caught:
            if issubclass(w.category, torch.jit.TracerWarning):
                seen.add((Path(w.filename).name, linecache.getline(w.filename, w.lineno).strip()))
    assert seen and seen <= KNOWN_TRACER_WARNINGS, sorted(seen - KNOWN_TRACER_WARNINGS)


@pytest.mark.parametrize("after,capacity,budget", [(0, 4, None), (2, 0, None), (2, 4, -1)])
def test_bad_settings_are_refused(after, capacity, budget):
    with pytest.raises(ValueError, match="after and capacity must be >= 1 and budget >= 0"):
        BatchTraces(lambda raw: raw, after=after, capacity=capacity, budget=budget)  # type: ignore[arg-type,return-value]
