"""Every executor (eager, fused with MILP / greedy groups, dali, module) against the numpy oracle: preset plans,
every op, list (multi-hot) columns, nulls, int64 extremes, empty rows and batches; bad input names the column."""
from __future__ import annotations

import functools
import logging

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from every_op_plan import f
from recforge.config import DatasetConfig, DenseFeature, MultiHotFeature, SparseFeature
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.columns import BatchError
from recforge.preprocess.executor import Executor, make_executor
from recforge.preprocess.executors.dali import dali_available
from recforge.preprocess.jagged import JaggedColumn, JaggedColumns
from recforge.preprocess.planning.plan import Plan, PlanError
from recforge.preprocess.presets import PRESET_PLANS, load_plan, preset_dataset
from recforge.preprocess.semantics.reference import apply_plan_rows_ref
from recforge.preprocess.synth import random_raw_batch, reference_inputs
from recforge_kernels.reference import sigrid_hash_ref

needs_dali = pytest.mark.skipif(not dali_available(), reason="nvidia-dali not installed")
EXECUTORS = ["eager", "fused", "fused_greedy", "fused_grouped", pytest.param("dali", marks=needs_dali)]

DS = DatasetConfig(
    name="small",
    dense=[DenseFeature(name=f"I{i}") for i in (1, 2, 3)],
    sparse=[SparseFeature(name=f"C{i}", cardinality=c) for i, c in zip((1, 2, 3, 4), (50, 7, 100_000, 3), strict=True)],
)


ALL_OPS = Plan.model_validate({"name": "all_ops", "features": [
    f("I1", "dense", "I1", ("fill_null", {"value": 0.5}), ("logit", {"eps": 1e-3})),
    f("I2", "dense", "I2", ("fill_null", {}), ("boxcox", {"lambda": 0.25}), ("clamp", {"lo": -2, "hi": 30}),
      ("boxcox", {"lambda": 0.0})),
    f("I3", "dense", "I3", ("fill_null", {}), ("onehot", {"lo": -4, "hi": 60, "C": 6}), ("ngram", {"n": 3}),
      ("firstx", {"X": 1})),
    f("C1", "sparse", "C1", ("fill_null", {"value": 3}), ("sigrid_hash", {"salt": 11, "M": 50}),
      ("ngram", {"n": 2}), ("firstx", {"X": 3})),
    f("C2", "sparse", "C2", ("fill_null", {}), ("mapid", {"map": [16, 15, 14, 2**40]}), ("clamp", {"lo": 0, "hi": 9})),
    f("C2h", "sparse", "C2", ("fill_null", {}), ("sigrid_hash", {"M": 7}), ("cast", {"to": "float"}),
      ("bucketize", {"borders": [0.5, 2.5, 4.0]})),
    f("I1f", "dense", "I1", ("fill_null", {}), ("cast", {"to": "id"}), ("cast", {"to": "float"}),
      ("clamp", {"lo": -1e6, "hi": 1e6})),
    f("I1c", "sparse", "I1", ("fill_null", {}), ("cast", {"to": "id"}), ("clamp", {"lo": 0, "hi": 20})),
    f("C3", "sparse", "C3", ("fill_null", {}), ("sigrid_hash", {"M": 100_000})),
    f("C3b", "sparse", "C3", ("fill_null", {}), ("sigrid_hash", {"M": 100_000}), ("clamp", {"lo": 5, "hi": 90_000})),
    f("C4", "sparse", "C4", ("fill_null", {}), ("sigrid_hash", {"M": 1}), ("firstx", {"X": 1})),
    f("I2b", "sparse", "I2", ("fill_null", {}), ("bucketize", {"borders": [0.5, 1.0, 1.5]}), table_rows=64),
    f("I3l", "dense", "I3", ("fill_null", {"value": -2}), ("clamp", {"lo": -5, "hi": 1e4}), ("log1p", {})),
    f("I1lb", "sparse", "I1", ("fill_null", {}), ("log1p", {}), ("bucketize", {"borders": [0.5, 2.0, 3.5]})),
]})


def build(name: str, plan: Plan, ds: DatasetConfig) -> Executor:
    if name == "fused_greedy":
        return make_executor("fused", plan, ds, method="greedy")
    if name == "fused_grouped":  # one call per fused group, never the single-pass form
        return make_executor("fused", plan, ds, single_pass=False)
    return make_executor(name, plan, ds)


def assert_matches_reference(plan: Plan, ds: DatasetConfig, raw: RawBatch, ex: Executor) -> None:
    dense, kjt = ex(raw)
    expected = apply_plan_rows_ref(plan, ds, *reference_inputs(raw))
    assert dense.dtype == torch.float32 and dense.shape == (raw.rows, len(plan.dense_features()))
    for j, n in enumerate(plan.dense_features()):
        want = np.array([r[0] for r in expected[n]], dtype=np.float32)
        np.testing.assert_allclose(dense[:, j].numpy(), want, rtol=1e-6, atol=0, equal_nan=True, err_msg=n)
    assert kjt.keys() == plan.sparse_features() and kjt.stride() == raw.rows
    for n, rows in plan.tables():
        got = kjt[n]
        want = np.concatenate(expected[n]) if expected[n] else np.zeros(0, np.int64)
        np.testing.assert_array_equal(got.lengths().numpy(), [len(r) for r in expected[n]], err_msg=n)
        np.testing.assert_array_equal(got.values().numpy(), want, err_msg=n)
        assert got.values().dtype == torch.int64
        assert ((got.values() >= 0) & (got.values() < rows)).all(), n


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", PRESET_PLANS)
def test_presets_match_reference(executor, name):
    ds = preset_dataset(name)
    plan = load_plan(name, ds)
    assert_matches_reference(plan, ds, random_raw_batch(ds, 24, seed=3), build(executor, plan, ds))


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("rows,seed,null_rate", [(64, 1, 0.3), (0, 2, 0.3), (5, 3, 1.0), (40, 4, 0.0)])
def test_every_op_matches_reference(executor, rows, seed, null_rate):
    raw = random_raw_batch(DS, rows, seed=seed, null_rate=null_rate, extreme_rate=0.2)
    assert_matches_reference(ALL_OPS, DS, raw, build(executor, ALL_OPS, DS))


LIST_PLAN = Plan.model_validate({"name": "lists", "features": [
    f("C1", "sparse", "C1", ("fill_null", {"value": 9}), ("sigrid_hash", {"M": 50}), ("firstx", {"X": 3})),
    f("C1n", "sparse", "C1", ("fill_null", {}), ("clamp", {"lo": 0, "hi": 2**40}), ("ngram", {"n": 2}),
      ("sigrid_hash", {"salt": 5, "M": 1000})),
    f("C2", "sparse", "C2", ("fill_null", {}), ("mapid", {"map": [4, 3, 2]})),
    f("C2b", "sparse", "C2", ("fill_null", {}), ("cast", {"to": "float"}), ("bucketize", {"borders": [0.0, 1e9]})),
    f("C3", "sparse", "C3", ("fill_null", {}), ("sigrid_hash", {"M": 100}), ("firstx", {"X": 1})),
    f("I1", "dense", "I1", ("fill_null", {}), ("logit", {})),
    f("I2", "dense", "I2", ("fill_null", {}), ("log1p", {})),
]})


@pytest.mark.parametrize("executor", EXECUTORS)
@settings(max_examples=12, deadline=None)
@given(rows=st.integers(0, 30), seed=st.integers(0, 10**6), max_list=st.integers(0, 6))
def test_list_columns_match_reference(executor, rows, seed, max_list):
    raw = random_raw_batch(DS, rows, seed=seed, list_columns=("C1", "C2"), max_list=max_list, extreme_rate=0.2)
    assert_matches_reference(LIST_PLAN, DS, raw, build(executor, LIST_PLAN, DS))


def test_list_columns_from_arrow():
    schema = pa.schema([("label", pa.int8()), ("I1", pa.int64()), ("I2", pa.int64()), ("I3", pa.int64()),
                        ("C1", pa.list_(pa.int64())), ("C2", pa.list_(pa.int64())), ("C3", pa.int64()),
                        ("C4", pa.int64())])
    rb = pa.RecordBatch.from_pylist([
        {"label": 1, "I1": 3, "C1": [5, None, 7], "C2": [], "C3": 1},
        {"label": 0, "I1": None, "C1": None, "C2": [0, 1, 2, 3], "C3": None},
        {"label": 1, "I1": -2, "C1": [2**62], "C2": [2], "C3": 8},
    ], schema=schema)
    raw = RawBatch.from_arrow(rb, DS)
    assert set(raw.jagged) == {"C1", "C2"}
    assert raw.jagged["C1"].lengths.tolist() == [3, 0, 1] and raw.jagged["C1"].valid.tolist() == [1, 0, 1, 1]
    assert not raw.sparse_valid[:, 0].any()  # the list column's slot in the matrix stays invalid
    for ex in ("eager", "fused"):
        dense, kjt = make_executor(ex, LIST_PLAN, DS)(raw)
        assert kjt["C2"].values().tolist() == [4, 3, 2, 0, 2] and kjt["C2"].lengths().tolist() == [0, 4, 1]
        c1 = kjt["C1"]
        assert c1.lengths().tolist() == [3, 0, 1]
        assert c1.values()[1].item() == sigrid_hash_ref(9, 0, 50)  # the null id was filled with 9, then hashed
    padded, w = raw.pad_to(5)
    assert padded.jagged["C1"].lengths.tolist() == [3, 0, 1, 0, 0] and w.tolist() == [1, 1, 1, 0, 0]
    sliced = RawBatch(**{k: getattr(raw, k)[1:3] for k in ("label", "dense", "dense_valid", "sparse", "sparse_valid",
                                                           "jagged")})
    assert sliced.jagged["C2"].lengths.tolist() == [4, 1] and sliced.jagged["C2"].values.tolist() == [0, 1, 2, 3, 2]


def test_ids_outside_int64_and_bad_columns_name_the_column():
    rb = pa.RecordBatch.from_pydict(
        {"label": pa.array([1], pa.int8()), "I1": pa.array([1], pa.int64()), "I2": pa.array([1], pa.int64()),
         "I3": pa.array([1], pa.int64()), "C1": pa.array([2**64 - 1], pa.uint64()), "C2": pa.array([1], pa.int64()),
         "C3": pa.array([1], pa.int64()), "C4": pa.array([1], pa.int64())})
    with pytest.raises(ValueError, match="'C1' holds ids outside the int64 range"):
        RawBatch.from_arrow(rb, DS)
    with pytest.raises(TypeError, match="dense column 'I1'"):
        RawBatch.from_arrow(rb.set_column(1, "I1", pa.array([[1]], pa.list_(pa.int64()))), DS)
    raw = random_raw_batch(DS, 4, seed=1)
    ex = make_executor("fused", ALL_OPS, DS)
    short = RawBatch(raw.label, raw.dense[:, :2], raw.dense_valid[:, :2], raw.sparse, raw.sparse_valid)
    with pytest.raises(BatchError, match=r"2 dense columns.*missing \['I3'\]"):
        ex(short)
    stray = RawBatch(raw.label, raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid,
                     jagged=JaggedColumns({"C9": JaggedColumn.from_rows([[1], [], [2], []])}))
    for name in ("eager", "fused"):
        with pytest.raises(BatchError, match="list column 'C9' is not a sparse column"):
            make_executor(name, ALL_OPS, DS)(stray)


def test_onehot_on_a_list_column_names_the_feature():
    p = Plan.model_validate({"name": "p", "features": [
        f("oh", "dense", "C1", ("fill_null", {}), ("onehot", {"lo": 0, "hi": 4, "C": 2}), ("firstx", {"X": 1}))]})
    raw = random_raw_batch(DS, 6, seed=2, list_columns=("C1",))
    for name in ("eager", "fused"):
        with pytest.raises(BatchError, match="feature 'oh'.*'onehot'.*list column"):
            make_executor(name, p, DS)(raw)


def test_plan_that_does_not_fit_names_feature_and_op():
    with pytest.raises(PlanError, match="feature 'I1'.*source column 'I1'"):
        ds3 = preset_dataset("plan3")
        no_dense = [c for c in ds3.columns if c.role != "dense"]
        make_executor("fused", ALL_OPS, ds3.model_copy(update={"columns": no_dense}))
    with pytest.raises(ValueError, match="unknown executor 'tvm'"):
        make_executor("tvm", ALL_OPS, DS)


def test_fused_runs_one_call_per_group():
    plan = load_plan("plan0")
    ex = make_executor("fused", plan, preset_dataset("plan0"), single_pass=False)
    ex(random_raw_batch(preset_dataset("plan0"), 8, seed=0))
    # 6 groups; the sparse fill_null group reads the dense matrix (bucketize's I1) and the sparse one (2 calls);
    # firstx(1) of one value per row is a column slice, no call: 6 calls
    assert len(ex.compiled.groups) == 6 and ex.calls == 6
    assert ex.describe()["launches"] == 6 and ex.describe()["executor"] == "fused"


# Every op, each feature keeping one value per row: the fused executor's single-pass form runs all of it.
SCALAR_OPS = Plan.model_validate({"name": "scalar_ops", "features": [
    f("I1", "dense", "I1", ("fill_null", {"value": 0.5}), ("logit", {"eps": 1e-3}), ("logit", {"eps": 0.2})),
    f("I2", "dense", "I2", ("fill_null", {}), ("boxcox", {"lambda": 0.25}), ("clamp", {"lo": -2, "hi": 30}),
      ("boxcox", {"lambda": 0.0})),
    f("I3", "dense", "I3", ("fill_null", {"value": -1}), ("onehot", {"lo": -4, "hi": 60, "C": 6}), ("ngram", {"n": 3}),
      ("firstx", {"X": 1})),
    f("C1oh", "dense", "C1", ("fill_null", {}), ("onehot", {"lo": 0, "hi": 2**40, "C": 3}), ("firstx", {"X": 1})),
    f("I1f", "dense", "I1", ("fill_null", {}), ("cast", {"to": "id"}), ("cast", {"to": "float"}),
      ("cast", {"to": "float"}), ("clamp", {"lo": -1e6, "hi": 1e6})),
    f("C1", "sparse", "C1", ("fill_null", {"value": 3}), ("sigrid_hash", {"salt": 11, "M": 50}),
      ("ngram", {"n": 2}), ("firstx", {"X": 3})),
    f("C2", "sparse", "C2", ("fill_null", {}), ("mapid", {"map": [16, 15, 14, 2**40]}), ("clamp", {"lo": 0, "hi": 9})),
    f("C2h", "sparse", "C2", ("fill_null", {}), ("sigrid_hash", {"M": 7}), ("cast", {"to": "float"}),
      ("bucketize", {"borders": [0.5, 2.5, 4.0]})),
    f("I1c", "sparse", "I1", ("fill_null", {}), ("cast", {"to": "id"}), ("clamp", {"lo": 0, "hi": 20})),
    f("C3", "sparse", "C3", ("fill_null", {}), ("sigrid_hash", {"M": 2**16}),
      ("sigrid_hash", {"salt": -7, "M": 2**40 + 3}), ("sigrid_hash", {"M": 100_000}),
      ("clamp", {"lo": 5, "hi": 90_000})),
    f("C4", "sparse", "C4", ("fill_null", {}), ("sigrid_hash", {"M": 1}), ("firstx", {"X": 1})),
    f("I2b", "sparse", "I2", ("fill_null", {}), ("bucketize", {"borders": [0.5, 1.0, 1.5]}), table_rows=64),
    f("I3l", "dense", "I3", ("fill_null", {"value": -2}), ("clamp", {"lo": -5, "hi": 1e4}), ("log1p", {}),
      ("log1p", {})),
    f("I1lb", "sparse", "I1", ("fill_null", {}), ("log1p", {}), ("bucketize", {"borders": [0.5, 2.0, 3.5]})),
]})


@functools.cache
def _scalar_executors():
    """Built once: compiling SCALAR_OPS (RAP's layer MILP over its long chains) takes seconds."""
    return make_executor("fused", SCALAR_OPS, DS), make_executor("fused", SCALAR_OPS, DS, single_pass=False)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(0, 300), seed=st.integers(0, 10**6), null_rate=st.sampled_from([0.0, 0.3, 1.0]))
def test_single_pass_matches_reference_and_groups(rows, seed, null_rate):
    single, grouped = _scalar_executors()
    raw = random_raw_batch(DS, rows, seed=seed, null_rate=null_rate, extreme_rate=0.2)
    assert_matches_reference(SCALAR_OPS, DS, raw, single)
    assert single.calls == 1 and "scalar column" in single.describe()["single_pass"]  # launches of the last batch
    (d1, k1), (d2, k2) = single(raw), grouped(raw)
    assert grouped.calls > 1
    torch.testing.assert_close(d1, d2, rtol=0, atol=0, equal_nan=True)  # the same per-value code: bit-identical
    assert torch.equal(k1.values(), k2.values()) and torch.equal(k1.lengths(), k2.lengths())


def test_single_pass_steps_aside_for_lists_and_wide_rows():
    # every valid plan keeps one value per row on scalar columns (ngram / firstx of one value, onehot cut by
    # firstx(1)); list columns in the batch are what sends it to the groups
    ex = make_executor("fused", LIST_PLAN, DS)
    ex(random_raw_batch(DS, 7, seed=1))
    assert ex.calls == 1
    ex(random_raw_batch(DS, 7, seed=1, list_columns=("C2",)))
    assert ex.calls > 1
    ex = make_executor("fused", SCALAR_OPS, DS)
    raw = random_raw_batch(DS, 20, seed=4, list_columns=("C2",))  # a list column: the groups run, one call each
    assert_matches_reference(SCALAR_OPS, DS, raw, ex)
    assert ex.calls > 1
    assert make_executor("fused", SCALAR_OPS, DS, single_pass=False).describe()["single_pass"].startswith("off")


@needs_dali
def test_dali_falls_back_explicitly(caplog):
    with caplog.at_level(logging.WARNING):
        ex = make_executor("dali", ALL_OPS, DS)
    d = ex.describe()
    assert (d["fallback_by_op"]["onehot"], d["fallback_by_op"]["boxcox"], d["fallback_by_op"]["mapid"]) == (1, 2, 1)
    assert "boxcox_dense" in d["fallback_reasons"] and d["dali_ops"] > 0
    assert "fall back to the fused executor" in caplog.text
    with caplog.at_level(logging.WARNING):
        ex(random_raw_batch(DS, 0, seed=0))
    assert ex.describe()["whole_batch_fallbacks"] == 1 and "runs on the fused executor" in caplog.text


def test_module_executor_takes_list_columns_like_eager():
    """The exportable module (evaluate's and serving's form) reads a multi-hot column as values + lengths."""
    plan, criteo = load_plan("plan0"), preset_dataset("plan0")
    raw = random_raw_batch(criteo, 6, seed=0, list_columns=("C1",), null_rate=0.0)  # ingest quarantines null elements
    with pytest.raises(ValueError, match=r"columns \['C1'\] arrive as lists but the dataset does not declare"):
        make_executor("module", plan, criteo)(raw)
    columns = [MultiHotFeature(name="C1", max_length=8) if c.name == "C1" else c for c in criteo.columns]
    ds = DatasetConfig(name="criteo_c1_multi_hot", columns=columns)
    (d1, k1), (d2, k2) = make_executor("module", plan, ds)(raw), make_executor("eager", plan, ds)(raw)
    torch.testing.assert_close(d1, d2)
    assert k1.keys() == k2.keys() and torch.equal(k1.lengths(), k2.lengths())
    assert torch.equal(k1.values(), k2.values())


def test_fused_chain_op_checks_its_program_and_has_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from recforge.preprocess.executors.chain import chain_program
    from recforge_kernels.fused import fused_chain

    prog = chain_program(SCALAR_OPS, DS)
    raw = random_raw_batch(DS, 9, seed=0)
    args = [raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid, prog.src_kind, prog.src_col, prog.out_kind,
            prog.out_slot, prog.step_offsets, prog.codes, prog.f0, prog.f1, prog.i0, prog.i1, prog.borders,
            prog.table, prog.num_dense, prog.num_sparse]
    dense, ids = fused_chain(*args)
    assert dense.shape == (9, prog.num_dense) and ids.shape == (9 * prog.num_sparse,)
    bad = list(args)
    bad[5] = [99] + prog.src_col[1:]
    with pytest.raises(RuntimeError, match="feature 0 reads column 99"):
        fused_chain(*bad)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        d, i = fused_chain(*fake)
    assert d.shape == dense.shape and i.shape == ids.shape and d.dtype == torch.float32
