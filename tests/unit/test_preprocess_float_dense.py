"""Float dense columns: RawBatch.from_arrow makes a float64 dense matrix when the dataset has a float column, and
every executor (eager, fused single pass / per group / torch fallback, module, dali) matches the numpy oracle on it."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recforge.config import DatasetConfig, criteo_kaggle_dataset
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.columns import BatchError
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors.dali import dali_available
from recforge.preprocess.planning.plan import Plan
from recforge.preprocess.semantics.reference import apply_plan_rows_ref
from recforge.preprocess.synth import random_raw_batch, reference_inputs
from recforge_kernels import cpu_ext

needs_dali = pytest.mark.skipif(not dali_available(), reason="nvidia-dali not installed")

DS = DatasetConfig.model_validate({"name": "floats", "format": "parquet", "columns": [
    {"role": "label", "name": "y"},
    {"role": "dense", "name": "price", "dtype": "float", "clip": [0, 1e4]},
    {"role": "dense", "name": "clicks", "dtype": "int"},
    {"role": "dense", "name": "score", "dtype": "float", "transform": "none"},
    {"role": "categorical", "name": "site", "encoding": "string", "cardinality": 500},
    {"role": "categorical", "name": "dev", "encoding": "int"},
]})


def f(name, kind, source, *ops, **extra):
    return {"name": name, "kind": kind, "source": source, "ops": [{"op": o, "params": p} for o, p in ops], **extra}


# every op a float value can meet, each feature keeping one value per row (so the single pass and module run it)
PLAN = Plan.model_validate({"name": "float_ops", "features": [
    f("price", "dense", "price", ("fill_null", {}), ("clamp", {"lo": 0, "hi": 1e4}), ("log1p", {})),
    f("clicks", "dense", "clicks", ("fill_null", {}), ("log1p", {})),
    f("score", "dense", "score", ("fill_null", {"value": 0.5})),
    f("score_l", "dense", "score", ("fill_null", {}), ("logit", {"eps": 1e-3})),
    f("score_b", "dense", "score", ("fill_null", {}), ("boxcox", {"lambda": 0.5})),
    f("score_oh", "dense", "score", ("fill_null", {}), ("onehot", {"lo": -4, "hi": 4, "C": 4}), ("firstx", {"X": 1})),
    f("price_b", "sparse", "price", ("fill_null", {}), ("bucketize", {"borders": [0.5, 10.0, 1e3]})),
    f("score_id", "sparse", "score", ("fill_null", {}), ("cast", {"to": "id"}), ("sigrid_hash", {"M": 97})),
    f("site", "sparse", "site", ("fill_null", {}), ("sigrid_hash", {"M": 500}), ("firstx", {"X": 1})),
    f("dev", "sparse", "dev", ("fill_null", {}), ("sigrid_hash", {"M": 64}), ("firstx", {"X": 1})),
]})


def check(plan: Plan, ds: DatasetConfig, raw: RawBatch, ex) -> None:
    dense, kjt = ex(raw)
    want = apply_plan_rows_ref(plan, ds, *reference_inputs(raw))
    assert dense.dtype == torch.float32 and dense.shape == (raw.rows, len(plan.dense_features()))
    for j, n in enumerate(plan.dense_features()):
        np.testing.assert_allclose(dense[:, j].numpy(), np.array([r[0] for r in want[n]], np.float32), rtol=1e-6,
                                   atol=0, equal_nan=True, err_msg=n)
    for n in plan.sparse_features():
        np.testing.assert_array_equal(kjt[n].values().numpy(), np.concatenate(want[n]) if want[n] else [], err_msg=n)


EXECUTORS = {
    "eager": lambda: make_executor("eager", PLAN, DS),
    "fused": lambda: make_executor("fused", PLAN, DS),
    "fused_grouped": lambda: make_executor("fused", PLAN, DS, single_pass=False),
    "fused_torch": lambda: make_executor("fused", PLAN, DS, native=False),
    "module": lambda: make_executor("module", PLAN, DS),
}


@pytest.mark.parametrize("name", [*EXECUTORS, pytest.param("dali", marks=needs_dali)])
@settings(max_examples=6, deadline=None)
@given(rows=st.integers(0, 80), seed=st.integers(0, 10**6), null_rate=st.sampled_from([0.0, 0.3, 1.0]))
def test_executors_match_reference_on_float_dense(name, rows, seed, null_rate):
    ex = make_executor("dali", PLAN, DS) if name == "dali" else EXECUTORS[name]()
    raw = random_raw_batch(DS, rows, seed=seed, null_rate=null_rate, extreme_rate=0.25)
    assert raw.dense.dtype == torch.float64
    check(PLAN, DS, raw, ex)


def test_fused_single_pass_takes_float64_and_equals_the_groups():
    raw = random_raw_batch(DS, 300, seed=7, extreme_rate=0.3)
    single, grouped = make_executor("fused", PLAN, DS), make_executor("fused", PLAN, DS, single_pass=False)
    (d1, k1), (d2, k2) = single(raw), grouped(raw)
    if cpu_ext.load():  # the C++ chain read the float64 matrix in one call
        assert single.calls == 1 and single.last_path == "cpp_single_pass"
    assert single.describe()["single_pass"].startswith("every feature")
    torch.testing.assert_close(d1, d2, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(k1.values(), k2.values())


def _arrow(rows: list[dict]) -> pa.RecordBatch:
    schema = pa.schema([("y", pa.int8()), ("price", pa.float64()), ("clicks", pa.int64()), ("score", pa.float64()),
                        ("site", pa.int64()), ("dev", pa.int64())])
    return pa.RecordBatch.from_pylist(rows, schema=schema)


def test_from_arrow_float_matrix_nan_is_missing_and_int_columns_convert():
    rb = _arrow([
        {"y": 1, "price": 2.5, "clicks": 3, "score": float("nan"), "site": 11, "dev": 2},
        {"y": 0, "price": None, "clicks": None, "score": -1e300, "site": None, "dev": 5},
        {"y": 1, "price": float("inf"), "clicks": 2**40, "score": 0.25, "site": -7, "dev": None},
    ])
    raw = RawBatch.from_arrow(rb, DS)
    assert raw.dense.dtype == torch.float64 and raw.dense.is_contiguous()
    assert raw.dense[:, 0].tolist() == [2.5, 0.0, float("inf")]
    assert raw.dense[:, 1].tolist() == [3.0, 0.0, float(2**40)]
    assert raw.dense_valid.tolist() == [[True, True, False], [False, False, True], [True, True, True]]
    assert raw.dense[0, 2].item() == 0.0  # a NaN is a missing value: 0 with valid False
    assert raw.sparse.dtype == torch.int64 and raw.sparse[:, 0].tolist() == [11, 0, -7]
    dense, _ = make_executor("fused", PLAN, DS)(raw)
    assert dense[:, 0].tolist() == pytest.approx([np.log1p(2.5), 0.0, np.log1p(1e4)], rel=1e-6)
    assert dense[1, 3].item() == pytest.approx(np.log(1e-3 / (1 - 1e-3)), rel=1e-4)  # -1e300 clamps to eps
    padded, _ = raw.pad_to(5)
    both = RawBatch.concat([raw, raw])
    assert padded.dense.dtype == both.dense.dtype == torch.float64 and both.rows == 6
    with pytest.raises(TypeError, match="float column 'price' must be a numeric type"):
        RawBatch.from_arrow(rb.set_column(1, "price", pa.array(["a", "b", "c"])), DS)


def test_criteo_dense_stays_int64():
    ds = criteo_kaggle_dataset()
    cols = {"label": pa.array([0, 1], pa.int8())}
    cols |= {n: pa.array([5, None], pa.int64()) for n in ds.dense_names}
    cols |= {n: pa.array([1, 2], pa.int64()) for n in ds.sparse_names}
    raw = RawBatch.from_arrow(pa.RecordBatch.from_pydict(cols), ds)
    assert raw.dense.dtype == torch.int64 and raw.dense[:, 0].tolist() == [5, 0]


def test_batches_of_other_dtypes_name_the_columns():
    raw = random_raw_batch(DS, 4, seed=1)
    bad = RawBatch(raw.label, raw.dense.to(torch.float32), raw.dense_valid, raw.sparse, raw.sparse_valid)
    with pytest.raises(BatchError, match=r"dense columns \['price', 'clicks', 'score'\].*int64 or float64"):
        make_executor("fused", PLAN, DS)(bad)
    bad = RawBatch(raw.label, raw.dense, raw.dense_valid, raw.sparse.to(torch.float64), raw.sparse_valid)
    with pytest.raises(BatchError, match="sparse columns.*must be int64"):
        make_executor("eager", PLAN, DS)(bad)
