"""RawBatch.from_arrow / pad_to, PreprocessModule (incl. torch.export) and TorchExecutor vs the numpy reference."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import DatasetConfig, DenseFeature, SparseFeature, criteo_kaggle_dataset
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import Executor, TorchExecutor
from recforge.preprocess.module import PreprocessModule
from recforge.preprocess.planning.plan import Plan, PlanError, criteo_plan
from recforge.preprocess.semantics.reference import apply_plan_ref

SMALL = DatasetConfig(
    name="small",
    dense=[DenseFeature(name="I1"), DenseFeature(name="I2"), DenseFeature(name="I3")],
    sparse=[SparseFeature(name=f"C{i}", cardinality=c) for i, c in enumerate([50, 7, 100_000, 3], start=1)],
)

# Every op, interleaved kinds (tests the output permutation), a derived sparse feature from a dense column,
# two sigrid_hash groups (different salts) and per-column moduli within a group.
MIXED_PLAN = Plan.model_validate({"name": "mixed", "features": [
    {"name": "C2", "kind": "sparse", "source": "C2",
     "ops": [{"op": "fill_null"}, {"op": "sigrid_hash", "params": {"M": 7}}, {"op": "firstx", "params": {"X": 1}}]},
    {"name": "I1", "kind": "dense", "source": "I1", "ops": [{"op": "fill_null"}, {"op": "logit"}]},
    {"name": "C1", "kind": "sparse", "source": "C1",
     "ops": [{"op": "fill_null"}, {"op": "sigrid_hash", "params": {"M": 50}}, {"op": "firstx", "params": {"X": 1}}]},
    {"name": "I3", "kind": "dense", "source": "I3",
     "ops": [{"op": "fill_null", "params": {"value": 2.5}}, {"op": "boxcox", "params": {"lambda": 0.5}},
             {"op": "clamp", "params": {"lo": -1.0, "hi": 40.0}}]},
    {"name": "I2", "kind": "dense", "source": "I2", "ops": [{"op": "fill_null"}, {"op": "logit"}]},
    {"name": "I1_bucket", "kind": "sparse", "source": "I1",
     "ops": [{"op": "fill_null"}, {"op": "bucketize", "params": {"borders": [0.5, 1.0, 1.5, 10.0]}}]},
    {"name": "C3", "kind": "sparse", "source": "C3",
     "ops": [{"op": "fill_null", "params": {"value": 5}}, {"op": "sigrid_hash", "params": {"salt": -77, "M": 1000}},
             {"op": "clamp", "params": {"lo": 0, "hi": 500}}]},
    {"name": "C4", "kind": "sparse", "source": "C4",
     "ops": [{"op": "fill_null"}, {"op": "clamp", "params": {"lo": 0, "hi": 2}}]},
    {"name": "C1_again", "kind": "sparse", "source": "C1",
     "ops": [{"op": "fill_null"}, {"op": "sigrid_hash", "params": {"M": 1}}, {"op": "firstx", "params": {"X": 1}}]},
]})


def arrow_schema(ds: DatasetConfig) -> pa.Schema:
    """The contract's shard schema: label int8 not null; dense int64 nullable; sparse int64 nullable."""
    return pa.schema(
        [pa.field(ds.label, pa.int8(), nullable=False)]
        + [pa.field(n, pa.int64()) for n in ds.dense_names]
        + [pa.field(n, pa.int64()) for n in ds.sparse_names]
    )


def random_batch(ds: DatasetConfig, rows: int, seed: int, null_rate: float = 0.3) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    cols = [pa.array(rng.integers(0, 2, rows), pa.int8())]
    for _ in ds.dense_names:
        v = rng.integers(-3, 50, rows)
        v[rng.random(rows) < 0.05] = rng.choice([np.iinfo(np.int64).max, np.iinfo(np.int64).min, 2**40])
        cols.append(pa.array([None if rng.random() < null_rate else int(x) for x in v], pa.int64()))
    for _ in ds.sparse_names:
        v = rng.integers(0, 2**32, rows)  # hex ids, parsed unsigned 32-bit
        v[rng.random(rows) < 0.05] = np.iinfo(np.int64).min
        cols.append(pa.array([None if rng.random() < null_rate else int(x) for x in v], pa.int64()))
    return pa.RecordBatch.from_arrays(cols, schema=arrow_schema(ds))


def raw_numpy(rb: pa.RecordBatch, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Values (nulls -> 0) and valid masks via to_pylist: an independent path from RawBatch.from_arrow."""
    lists = [rb.column(n).to_pylist() for n in names]
    shape = (rb.num_rows, len(names))
    values = np.array([[0 if v is None else v for v in col] for col in lists], dtype=np.int64).T.reshape(shape)
    valid = np.array([[v is not None for v in col] for col in lists], dtype=bool).T.reshape(shape)
    return values, valid


def reference_outputs(plan: Plan, ds: DatasetConfig, rb: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    d, dv = raw_numpy(rb, ds.dense_names)
    s, sv = raw_numpy(rb, ds.sparse_names)
    return apply_plan_ref(plan, ds, d, dv, s, sv)


# ---------------------------------------------------------------- RawBatch


def test_from_arrow_nulls_and_values():
    rb = pa.RecordBatch.from_arrays(
        [pa.array([1, 0, 1], pa.int8()),
         pa.array([5, None, -7], pa.int64()), pa.array([None, None, 2**62], pa.int64()),
         pa.array([0, 1, 2], pa.int64()),
         pa.array([0xFFFFFFFF, None, 3], pa.int64()), pa.array([None, 9, None], pa.int64()),
         pa.array([1, 2, 3], pa.int64()), pa.array([None, None, None], pa.int64())],
        schema=arrow_schema(SMALL),
    )
    raw = RawBatch.from_arrow(rb, SMALL)
    assert raw.rows == 3
    assert raw.label.dtype == torch.float32 and raw.label.tolist() == [1.0, 0.0, 1.0]
    assert raw.dense.dtype == torch.int64 and raw.sparse.dtype == torch.int64
    assert raw.dense.tolist() == [[5, 0, 0], [0, 0, 1], [-7, 2**62, 2]]
    assert raw.dense_valid.tolist() == [[True, False, True], [False, False, True], [True, True, True]]
    assert raw.sparse.tolist() == [[0xFFFFFFFF, 0, 1, 0], [0, 9, 2, 0], [3, 0, 3, 0]]
    assert raw.sparse_valid[:, 3].tolist() == [False, False, False]
    assert raw.sparse_valid[:, 0].tolist() == [True, False, True]


def test_from_arrow_table_with_chunks_and_reordered_columns():
    rb = random_batch(SMALL, 20, seed=1)
    table = pa.concat_tables([pa.Table.from_batches([rb.slice(0, 7)]), pa.Table.from_batches([rb.slice(7)])])
    table = table.select(list(reversed(table.column_names)))
    a, b = RawBatch.from_arrow(rb, SMALL), RawBatch.from_arrow(table, SMALL)
    for name in ("label", "dense", "dense_valid", "sparse", "sparse_valid"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_from_arrow_errors():
    rb = random_batch(SMALL, 4, seed=2)
    with pytest.raises(ValueError, match="C4"):
        RawBatch.from_arrow(rb.drop_columns(["C4"]), SMALL)
    labels = [pa.array([0, None, 1, 1], pa.int8()), pa.array([0, 2, 1, 1], pa.int8())]
    for bad, msg in zip(labels, ["nulls", "not in"], strict=True):
        with pytest.raises(ValueError, match=msg):
            RawBatch.from_arrow(rb.set_column(0, pa.field("label", pa.int8()), bad), SMALL)
    with pytest.raises(TypeError, match="'I2'"):
        RawBatch.from_arrow(rb.set_column(2, "I2", pa.array([1.5, 2.0, None, 0.0])), SMALL)


def test_from_arrow_empty_batch():
    raw = RawBatch.from_arrow(random_batch(SMALL, 0, seed=3), SMALL)
    assert raw.rows == 0 and raw.dense.shape == (0, 3) and raw.sparse_valid.shape == (0, 4)


def test_pad_to():
    raw = RawBatch.from_arrow(random_batch(SMALL, 5, seed=4), SMALL)
    padded, weight = raw.pad_to(8)
    assert padded.rows == 8 and padded.dense.shape == (8, 3) and padded.sparse.shape == (8, 4)
    assert weight.dtype == torch.float32 and weight.tolist() == [1.0] * 5 + [0.0] * 3
    assert torch.equal(padded.sparse[:5], raw.sparse) and torch.equal(padded.dense_valid[:5], raw.dense_valid)
    assert not padded.dense[5:].any() and not padded.dense_valid[5:].any() and not padded.sparse_valid[5:].any()
    assert not padded.label[5:].any()
    assert raw.rows == 5  # the original is untouched
    same, w = raw.pad_to(5)
    assert same.rows == 5 and w.tolist() == [1.0] * 5 and same.dense.data_ptr() != raw.dense.data_ptr()
    with pytest.raises(ValueError, match="cannot pad 5 rows down to 4"):
        raw.pad_to(4)
    empty = RawBatch.from_arrow(random_batch(SMALL, 0, seed=5), SMALL)
    full, w = empty.pad_to(3)
    assert full.rows == 3 and w.tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- module / executor vs reference


@pytest.mark.parametrize(
    "plan,ds,rows,seed",
    [
        (criteo_plan(criteo_kaggle_dataset(), table_cap=1000), criteo_kaggle_dataset(), 48, 10),
        (MIXED_PLAN, SMALL, 64, 11),
        (MIXED_PLAN, SMALL, 0, 12),
    ],
)
def test_executor_matches_reference(plan, ds, rows, seed):
    rb = random_batch(ds, rows, seed)
    exp_dense, exp_ids = reference_outputs(plan, ds, rb)
    ex = TorchExecutor(plan, ds)
    assert isinstance(ex, Executor)
    dense, kjt = ex(RawBatch.from_arrow(rb, ds))
    assert dense.dtype == torch.float32 and dense.shape == (rows, len(plan.dense_features()))
    np.testing.assert_allclose(dense.numpy(), exp_dense, rtol=1e-6, atol=1e-6)
    assert isinstance(kjt, KeyedJaggedTensor)
    assert kjt.keys() == plan.sparse_features() and kjt.stride() == rows
    assert kjt.lengths().tolist() == [1] * (rows * len(plan.sparse_features()))
    for j, key in enumerate(plan.sparse_features()):
        np.testing.assert_array_equal(kjt[key].values().numpy(), exp_ids[:, j])
    for name, n in plan.tables():
        assert ((kjt[name].values() >= 0) & (kjt[name].values() < n)).all(), name


def test_criteo_plan_fuses_into_one_dense_and_one_sparse_group():
    module = PreprocessModule(criteo_plan(criteo_kaggle_dataset(), 1000), criteo_kaggle_dataset())
    assert [(g.kind, len(g.names)) for g in module.groups] == [("dense", 13), ("sparse", 26)]
    mixed = PreprocessModule(MIXED_PLAN, SMALL)
    assert sorted(len(g.names) for g in mixed.groups) == [1, 1, 1, 1, 2, 3]


def test_module_rejects_plan_that_does_not_fit_and_wrong_widths():
    with pytest.raises(PlanError, match="feature 'I4': source column 'I4'"):
        PreprocessModule(criteo_plan(criteo_kaggle_dataset(), 10), SMALL)
    module = PreprocessModule(MIXED_PLAN, SMALL)
    raw = RawBatch.from_arrow(random_batch(SMALL, 3, seed=6), SMALL)
    with pytest.raises(ValueError, match="expected 3 dense"):
        module(raw.dense[:, :2], raw.dense_valid[:, :2], raw.sparse, raw.sparse_valid)


def test_export_with_dynamic_batch_matches_eager():
    module = PreprocessModule(MIXED_PLAN, SMALL)
    example = RawBatch.from_arrow(random_batch(SMALL, 16, seed=7), SMALL)
    batch = torch.export.Dim("batch")
    args = (example.dense, example.dense_valid, example.sparse, example.sparse_valid)
    ep = torch.export.export(module, args, dynamic_shapes=tuple({0: batch} for _ in args))
    assert any("recforge.sigrid_hash_multi" in str(n.target) for n in ep.graph.nodes)
    for rows, seed in ((37, 8), (1, 9)):
        other = RawBatch.from_arrow(random_batch(SMALL, rows, seed), SMALL)
        inputs = (other.dense, other.dense_valid, other.sparse, other.sparse_valid)
        got, want = ep.module()(*inputs), module(*inputs)
        assert got[0].shape == (rows, 3) and got[1].shape == (rows, 6)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
