"""The default plan derived from a dataset's roles (schema_plan / load_plan("schema")), on three schemas: Criteo
Kaggle, a CSV export with float / int dense and string / int categoricals, a Parquet file with a multi-hot column.
Arrow batches typed as ingested shards are -> RawBatch -> eager / fused executors vs the numpy oracle; RECom's
compiler vs the uncompiled model where the serving form takes the schema."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

import recforge.recom as recom
from recforge.config import DatasetConfig, ModelConfig, PipelineConfig, load_dataset
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import make_executor
from recforge.preprocess.module import PreprocessModule
from recforge.preprocess.planning.plan import schema_plan
from recforge.preprocess.presets import load_plan
from recforge.preprocess.semantics.reference import apply_plan_rows_ref
from recforge.preprocess.synth import reference_inputs
from recforge.recom import check_against_eager
from recforge.recom.inference import InferenceModule
from recforge.train.model import build_dlrm
from recforge_kernels.reference import sigrid_hash_ref

CAP = 1000

CSV = DatasetConfig.model_validate({"name": "clicks_csv", "format": "csv", "header": True, "columns": [
    {"role": "ignore", "name": "id"},
    {"role": "timestamp", "name": "hour", "format": "%y%m%d%H"},
    {"role": "label", "name": "click", "positive": ["1", "yes"], "negative": ["0", "no"]},
    {"role": "dense", "name": "price", "dtype": "float", "clip": [0, 5000]},
    {"role": "dense", "name": "dwell_s", "dtype": "float", "transform": "none"},
    {"role": "dense", "name": "views_7d", "dtype": "int"},
    {"role": "categorical", "name": "site", "encoding": "string", "cardinality": 40_000},
    {"role": "categorical", "name": "device_type", "encoding": "int", "cardinality": 7},
    {"role": "categorical", "name": "app", "encoding": "string"},
]})

MULTI = DatasetConfig.model_validate({"name": "events_parquet", "format": "parquet", "columns": [
    {"role": "label", "name": "label"},
    {"role": "dense", "name": "n_items", "dtype": "int"},
    {"role": "categorical", "name": "user", "encoding": "int", "cardinality": 300},
    {"role": "multi_hot", "name": "genres", "encoding": "int", "max_length": 3, "cardinality": 50},
    {"role": "timestamp", "name": "ts", "format": "unix"},
]})

CRITEO = load_dataset("criteo_kaggle")
SCHEMAS = {"criteo": CRITEO, "csv": CSV, "multi_hot": MULTI}


def arrow_batch(ds: DatasetConfig, rows: int, seed: int) -> pa.RecordBatch:
    """An ingested shard's batch: label int8, dense int64 / float64, categorical int64, multi_hot list<int64>,
    timestamp timestamp[s, UTC]; nulls, negatives, NaN, empty and null lists, lists longer than max_length."""
    rng = np.random.default_rng(seed)
    arrays, fields = [], []
    for c in ds.columns:
        null = rng.random(rows) < 0.2
        if c.role == "ignore":
            continue
        if c.role == "label":
            arr, t = pa.array(rng.integers(0, 2, rows), pa.int8()), pa.int8()
        elif c.role == "timestamp":
            t = pa.timestamp("s", tz="UTC")
            arr = pa.array(rng.integers(1_700_000_000, 1_700_086_400, rows), pa.int64()).cast(t)
        elif c.role == "dense" and c.dtype == "float":
            x = rng.lognormal(2.0, 2.0, rows) * rng.choice([1, 1, 1, -1], rows)
            x[rng.random(rows) < 0.05] = np.nan
            arr, t = pa.array(x, pa.float64(), mask=null), pa.float64()
        elif c.role == "dense":
            arr, t = pa.array(rng.integers(-2, 5000, rows), pa.int64(), mask=null), pa.int64()
        elif c.role == "categorical":
            ids = rng.integers(-(2**63), 2**63 - 1, rows, dtype=np.int64)
            arr, t = pa.array(ids, pa.int64(), mask=null), pa.int64()
        else:  # multi_hot
            t = pa.list_(pa.int64())
            lists = [None if null[i] else [None if rng.random() < 0.1 else int(v)
                                           for v in rng.integers(0, 2**40, rng.integers(0, 7))] for i in range(rows)]
            arr = pa.array(lists, t)
        arrays.append(arr)
        fields.append(pa.field(c.name, t))
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))


def test_schema_plan_chains_follow_the_roles():
    p = schema_plan(CSV, CAP)
    chains = {f.name: [(s.op, s.params) for s in f.ops] for f in p.features}
    assert chains["price"] == [("fill_null", {"value": 0}), ("clamp", {"lo": 0.0, "hi": 5000.0}), ("log1p", {})]
    assert chains["dwell_s"] == [("fill_null", {"value": 0})]
    assert chains["views_7d"] == [("fill_null", {"value": 0}), ("log1p", {})]
    assert chains["site"] == [("fill_null", {"value": 0}), ("sigrid_hash", {"salt": 0, "M": CAP}), ("firstx", {"X": 1})]
    # min(cardinality x 64, cap); cap if unknown
    assert p.tables() == [("site", CAP), ("device_type", 7 * 64), ("app", CAP)]
    assert p.dense_features() == ["price", "dwell_s", "views_7d", "price_missing", "dwell_s_missing",
                                  "views_7d_missing"]  # label, id and timestamp columns are not features
    assert chains["price_missing"] == [("fill_null", {"value": -1}), ("clamp", {"lo": -1, "hi": 0})]
    m = schema_plan(MULTI, CAP)
    assert [(s.op, s.params) for s in m.features[-1].ops][-1] == ("firstx", {"X": 3})
    assert m.tables() == [("user", CAP), ("genres", CAP)]  # 300 and 50 known values
    assert schema_plan(MULTI, CAP, hash_headroom=1).tables() == [("user", 300), ("genres", 50)]
    c = schema_plan(CRITEO, CAP)
    assert [s.op for s in c.features[0].ops] == ["fill_null", "log1p"] and len(c.features) == 13 + 13 + 26
    assert dict(c.tables())["C9"] == 3 * 64 and dict(c.tables())["C3"] == CAP
    assert c.name.endswith("_x64") and schema_plan(CRITEO, CAP, 2).name.endswith("_x2")
    with pytest.raises(ValueError, match="table_cap must be >= 1"):
        schema_plan(CSV, 0)
    with pytest.raises(ValueError, match="hash_headroom must be >= 1"):
        schema_plan(CSV, CAP, 0)


@pytest.mark.parametrize(("headroom", "lo", "hi"), [(1, 0.55, 0.70), (64, 0.0, 0.04)])
def test_hash_headroom_keeps_known_values_in_rows_of_their_own(headroom, lo, hi):
    """n distinct raw values hashed into n rows share a row ~63% of the time (1 - 1/e); into 64 n rows ~1.5%. The
    share is measured on the plan's own sigrid_hash modulus, on 2,000 values of a column of that cardinality."""
    ds = DatasetConfig.model_validate({"name": "one", "format": "csv", "columns": [
        {"role": "label", "name": "y"}, {"role": "categorical", "name": "c", "encoding": "int", "cardinality": 2000}]})
    plan = schema_plan(ds, 10**9, hash_headroom=headroom)
    (chain,) = [f.ops for f in plan.features if f.name == "c"]
    modulus = next(op.params["M"] for op in chain if op.op == "sigrid_hash")
    assert modulus == 2000 * headroom
    rows = np.array([sigrid_hash_ref(v, 0, modulus) for v in range(1, 2001)])
    _, inverse, counts = np.unique(rows, return_inverse=True, return_counts=True)
    shared = float((counts[inverse] > 1).mean())
    assert lo <= shared <= hi, f"headroom {headroom}: {shared:.3f} of the values share a row"


def test_the_pipeline_passes_its_hash_headroom_to_the_schema_plan():
    cfg = PipelineConfig()
    assert cfg.hash_headroom == 64
    assert load_plan("schema", CSV, CAP, cfg.hash_headroom) == schema_plan(CSV, CAP)
    assert dict(load_plan("schema", CSV, CAP, 3).tables())["device_type"] == 21
    assert dict(load_plan("criteo", CSV, CAP, 3).tables())["device_type"] == 7  # RAP's plan 0 keeps its sizes
    with pytest.raises(ValueError, match="hash_headroom"):
        PipelineConfig(hash_headroom=0)


def test_load_plan_schema_is_the_pipeline_default():
    assert PipelineConfig().preprocess_plan == "schema"
    assert "log1p" in PipelineConfig.model_fields["preprocess_plan"].description
    assert load_plan("schema", CSV, CAP) == schema_plan(CSV, CAP)
    assert [s.op for s in load_plan("criteo", CSV, CAP).features[0].ops] == ["fill_null", "logit"]  # RAP plan 0
    with pytest.raises(ValueError, match=r"load_plan\('schema'\) needs the dataset"):
        load_plan("schema")
    with pytest.raises(ValueError, match="neither a preset"):
        load_plan("nope")


@pytest.mark.parametrize("schema", SCHEMAS)
def test_executors_match_reference_on_arrow_batches(schema):
    ds = SCHEMAS[schema]
    plan = load_plan("schema", ds, CAP)
    raw = RawBatch.from_arrow(arrow_batch(ds, 60 if schema == "criteo" else 150, seed=len(schema)), ds)
    assert raw.dense.dtype == (torch.float64 if schema == "csv" else torch.int64)
    assert set(raw.jagged) == ({"genres"} if schema == "multi_hot" else set())
    want = apply_plan_rows_ref(plan, ds, *reference_inputs(raw))
    runs = ["eager", "fused", "fused_grouped"] + ([] if schema == "multi_hot" else ["module"])
    for name in runs:
        ex = make_executor("fused", plan, ds, single_pass=False) if name == "fused_grouped" else \
            make_executor(name, plan, ds)
        dense, kjt = ex(raw)
        for j, n in enumerate(plan.dense_features()):
            np.testing.assert_allclose(dense[:, j].numpy(), [r[0] for r in want[n]], rtol=1e-6, atol=0,
                                       err_msg=f"{name} {n}")
        assert bool(torch.isfinite(dense).all())  # log1p of clamped / non-negative counts, NaN read as missing
        for n, rows in plan.tables():
            np.testing.assert_array_equal(kjt[n].lengths().numpy(), [len(r) for r in want[n]], err_msg=f"{name} {n}")
            np.testing.assert_array_equal(kjt[n].values().numpy(), np.concatenate(want[n]), err_msg=f"{name} {n}")
            assert bool(((kjt[n].values() >= 0) & (kjt[n].values() < rows)).all())


def test_multi_hot_keeps_up_to_max_length_ids_per_row():
    rb = pa.RecordBatch.from_pydict({
        "label": pa.array([1, 0, 1, 0], pa.int8()), "n_items": pa.array([3, None, 0, 1], pa.int64()),
        "user": pa.array([5, 6, None, 8], pa.int64()),
        "genres": pa.array([[1, 2, 3, 4, 5], None, [7, None], []], pa.list_(pa.int64())),
        "ts": pa.array([0, 1, 2, 3], pa.timestamp("s", tz="UTC"))})
    plan = schema_plan(MULTI, CAP)
    raw = RawBatch.from_arrow(rb, MULTI)
    for name in ("eager", "fused"):
        _, kjt = make_executor(name, plan, MULTI)(raw)
        g = kjt["genres"]
        assert g.lengths().tolist() == [3, 0, 2, 0]  # firstx(3) on a jagged column: up to 3 ids per row
        rows = dict(plan.tables())["genres"]  # CAP: 50 known values x 64 is more
        assert g.values().tolist() == [sigrid_hash_ref(v, 0, rows) for v in (1, 2, 3, 7, 0)]  # the null id -> 0
        assert kjt["user"].lengths().tolist() == [1, 1, 1, 1]
    assert PreprocessModule(plan, MULTI).list_columns == ["genres"]  # served as a jagged input (test_serving_multi_hot)


def test_recom_compiles_the_schema_plan_with_float_dense():
    """The compile stage's form (PreprocessModule + DLRM, lowered to gathers) over a float64 dense matrix."""
    plan = schema_plan(CSV, CAP)
    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1])
    dlrm = build_dlrm(cfg, plan.tables(), len(plan.dense_features()), "cpu")
    eager = InferenceModule(PreprocessModule(plan, CSV), dlrm).eval()
    raw = RawBatch.from_arrow(arrow_batch(CSV, 64, seed=3), CSV)
    example = (raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid)
    assert raw.dense.dtype == torch.float64
    compiled = recom.compile(eager.lowered(), example, backend="export")
    other = RawBatch.from_arrow(arrow_batch(CSV, 37, seed=4), CSV)
    inputs = (other.dense, other.dense_valid, other.sparse, other.sparse_valid)
    assert check_against_eager(compiled, eager, inputs, atol=1e-5) <= 1e-5
    assert compiled.metadata["num_columns"] == len(plan.tables())  # every column fused


class _MultiHotColumnModel(torch.nn.Module):
    """The schema plan's multi_hot chain written over a jagged input, as a serving model would take it:
    fill_null -> sigrid_hash -> firstx(3) (a 0/1 weight per id) -> pooled sum, then a linear head."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(50, 4))
        self.head = torch.nn.Linear(5, 1)

    def forward(self, dense, values, lengths, valid):
        ids = torch.ops.recforge.sigrid_hash(torch.where(valid, values, torch.zeros_like(values)), 0, 50)
        starts = torch.cumsum(lengths, 0) - lengths
        rows = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths, output_size=values.shape[0])
        keep = ((torch.arange(values.shape[0]) - starts[rows]) < 3).to(torch.float32)
        pooled = torch.nn.functional.embedding_bag(ids, self.weight, starts, mode="sum", per_sample_weights=keep)
        return torch.sigmoid(self.head(torch.cat([dense.float().unsqueeze(1), pooled], 1))).squeeze(1)


def _jagged_inputs(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (rows,), generator=g)
    n = int(lengths.sum())
    return (torch.randn(rows, dtype=torch.float64, generator=g), torch.randint(0, 2**40, (n,), generator=g), lengths,
            torch.rand(n, generator=g) > 0.1)


def test_recom_compiles_a_multi_hot_column_as_captured_with_the_reason():
    """RECom's column compiler does not fuse this jagged column (recorded per column); the compiled model still
    matches the uncompiled one on other batch and list sizes."""
    torch.manual_seed(0)
    model = _MultiHotColumnModel().eval()
    batch, nnz = torch.export.Dim("batch", min=1), torch.export.Dim("nnz", min=2)
    with pytest.warns(UserWarning, match="no column could be fused"):
        compiled = recom.compile(model, _jagged_inputs(16, 0), backend="export",
                                 dynamic_shapes=({0: batch}, {0: nnz}, {0: batch}, {0: nnz}))
    [column] = compiled.metadata["recom"]["per_column"]
    assert column["status"] == "residual" and column["reason"]
    other = _jagged_inputs(9, 1)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*other), model(*other), rtol=0, atol=1e-6)


def test_missing_indicators_keep_a_missing_count_apart_from_a_zero():
    plan = schema_plan(CSV, CAP)
    assert plan.dense_features() == ["price", "dwell_s", "views_7d",
                                     "price_missing", "dwell_s_missing", "views_7d_missing"]
    batch = pa.record_batch({"click": pa.array([1, 0, 1], pa.int8()), "price": pa.array([0.0, None, 3.0]),
                             "dwell_s": pa.array([1.0, 2.0, None]), "views_7d": pa.array([0, None, -2]),
                             "site": pa.array([1, 2, 3]), "device_type": pa.array([1, 2, 3]),
                             "app": pa.array([1, 2, 3]), "hour": pa.array([0, 0, 0], pa.timestamp("s", "UTC"))})
    dense, _ = make_executor("fused", plan, CSV)(RawBatch.from_arrow(batch, CSV))
    got = dense.numpy()
    assert got[0, 2] == got[1, 2] == 0.0  # views_7d: a count of 0 and a missing count both give log1p 0
    assert got[:, 3].tolist() == [0.0, -1.0, 0.0]  # price present, missing, present
    assert got[:, 4].tolist() == [0.0, 0.0, -1.0]
    assert got[:, 5].tolist() == [0.0, -1.0, -1.0]  # a negative count is flagged like a missing one


def test_missing_indicator_can_be_turned_off_and_a_name_clash_is_named():
    off = DatasetConfig.model_validate({**CSV.model_dump(mode="json"), "columns": [
        {**c.model_dump(mode="json"), "missing_indicator": False} if c.role == "dense" else c.model_dump(mode="json")
        for c in CSV.columns]})
    assert schema_plan(off, CAP).dense_features() == ["price", "dwell_s", "views_7d"]
    clash = DatasetConfig.model_validate({"name": "clash", "format": "csv", "header": True, "columns": [
        {"role": "label", "name": "y"}, {"role": "dense", "name": "a"}, {"role": "dense", "name": "a_missing"},
        {"role": "categorical", "name": "c", "encoding": "int"}]})
    with pytest.raises(ValueError, match="'a'.s missing indicator would be named a_missing"):
        schema_plan(clash, CAP)
