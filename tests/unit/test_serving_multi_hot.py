"""Serving a model over a multi-hot schema: the inference module takes list columns as a jagged input (values +
lengths), RECom compiles it (list columns pooled as captured, with the reason recorded), the compile report, the
pyfunc and the compile stage's held-out inputs carry it; a schema without list columns keeps the four inputs."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

import recforge.recom as recom
from recforge.config import DatasetConfig, ModelConfig, PipelineConfig, load_dataset
from recforge.data import ingest
from recforge.pipelines.context import RunContext, StageWriter
from recforge.pipelines.outputs import IngestOutputs, SplitOutputs
from recforge.pipelines.stages.serve import _holdout_inputs
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import make_executor
from recforge.preprocess.module import PreprocessModule
from recforge.preprocess.planning.plan import schema_plan
from recforge.recom.inference import InferenceModule
from recforge.recom.report import compile_report
from recforge.recom.serving import load_predictor
from recforge.train.model import build_dlrm

CAP = 1000
SCHEMA = {"name": "clicks_multi", "format": "parquet", "columns": [
    {"role": "label", "name": "label"},
    {"role": "dense", "name": "n_items", "dtype": "int"},
    {"role": "multi_hot", "name": "genres", "encoding": "int", "max_length": 3, "cardinality": 50},
    {"role": "categorical", "name": "user", "encoding": "int", "cardinality": 300},
    {"role": "multi_hot", "name": "tags", "encoding": "int", "max_length": 2, "cardinality": 20},
]}
MULTI = DatasetConfig.model_validate(SCHEMA)
JAGGED_KEYS = ["genres", "genres_lengths", "tags", "tags_lengths"]


def shard_batch(rows: int, seed: int, max_len: int = 6) -> pa.RecordBatch:
    """Typed like an ingested shard: label int8, dense int64, categorical int64, multi_hot list<int64> (null and
    empty lists, lists longer than max_length; no null element: ingest quarantines those)."""
    rng = np.random.default_rng(seed)

    def lists():
        return pa.array([None if rng.random() < 0.2 else [int(v) for v in rng.integers(-2**40, 2**40, rng.integers(
            0, max_len + 1))] for _ in range(rows)], pa.list_(pa.int64()))

    def ints(hi):
        return pa.array(rng.integers(0, hi, rows), pa.int64(), mask=rng.random(rows) < 0.2)

    return pa.RecordBatch.from_pydict({
        "label": pa.array(rng.integers(0, 2, rows), pa.int8()), "n_items": ints(100), "genres": lists(),
        "user": ints(10**6), "tags": lists()})


def inputs_of(raw: RawBatch, columns=("genres", "tags")) -> tuple:
    jagged = {}
    for n in columns:
        jagged[n], jagged[n + "_lengths"] = raw.jagged[n].values, raw.jagged[n].lengths
    return (raw.dense, raw.dense_valid, raw.sparse, raw.sparse_valid, jagged)


@pytest.fixture(scope="module")
def eager() -> InferenceModule:
    plan = schema_plan(MULTI, CAP)
    torch.manual_seed(0)
    cfg = ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1])
    dlrm = build_dlrm(cfg, plan.tables(), len(plan.dense_features()), "cpu")
    return InferenceModule(PreprocessModule(plan, MULTI), dlrm).eval()


@pytest.fixture(scope="module")
def compiled(eager):
    """Compiled on an example whose `tags` lists are all empty (a day may have none): traced on a padded copy."""
    rb = shard_batch(64, seed=1)
    raw = RawBatch.from_arrow(rb.set_column(4, "tags", pa.array([[]] * 64, pa.list_(pa.int64()))), MULTI)
    return recom.compile(eager.lowered(), inputs_of(raw), backend="export")


def test_eager_module_matches_the_training_executor(eager):
    """The module's firstx-as-keep-mask gives the ids the executors give the trainer: same DLRM output."""
    raw = RawBatch.from_arrow(shard_batch(50, seed=2), MULTI)
    assert eager.preprocess.list_columns == ["genres", "tags"]
    dense, kjt = make_executor("eager", eager.preprocess.plan, MULTI)(raw)
    assert kjt["genres"].lengths().max() == 3 and raw.jagged["genres"].lengths.max() > 3  # firstx cut something
    with torch.no_grad():
        want = torch.sigmoid(eager.dlrm(dense, kjt)).squeeze(-1)
        got = eager(*inputs_of(raw))
        gathered = eager.lowered()(*inputs_of(raw))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(gathered, want, rtol=0, atol=1e-6)


def test_compiled_matches_eager_on_held_out_rows(eager, compiled):
    meta = compiled.metadata
    assert compiled.input_names == ["dense", "dense_valid", "sparse", "sparse_valid",
                                    *(f"jagged_{k}" for k in JAGGED_KEYS)]
    assert meta["input_aliases"] == ["dense", "dense_valid", "sparse", "sparse_valid", *JAGGED_KEYS]
    assert meta["recom"]["fused"] == 1 and set(meta["recom"]["residual"]) == {"tables.genres.weight",
                                                                               "tables.tags.weight"}
    assert all("embedding_bag" in why for why in meta["recom"]["residual"].values())  # the reason is recorded
    assert any("2 values per list column" in note for note in meta["capture_notes"])
    assert meta["example_max_abs_diff"] <= 1e-5 and meta["one_row_max_abs_diff"] <= 1e-5
    held_out = inputs_of(RawBatch.from_arrow(shard_batch(300, seed=3), MULTI))
    report = compile_report(eager, compiled, held_out, batch_size=16, repeats=2, warmup=1)
    assert report["within_tolerance"] and report["heldout_rows"] == 300 and report["num_tables"] == 3


@pytest.mark.parametrize("case", ["one_row", "values_equal_batch", "all_empty"])
def test_dynamic_rows_and_values(eager, compiled, case):
    if case == "one_row":
        raw = RawBatch.from_arrow(shard_batch(1, seed=4, max_len=1), MULTI)
    elif case == "values_equal_batch":  # N == B must not be taken for a batch-major size
        rb = shard_batch(5, seed=5)
        one = pa.array([[7], [8], [9], [10], [11]], pa.list_(pa.int64()))
        raw = RawBatch.from_arrow(rb.set_column(2, "genres", one), MULTI)
    else:
        rb = shard_batch(6, seed=6)
        empty = pa.array([[]] * 6, pa.list_(pa.int64()))
        raw = RawBatch.from_arrow(rb.set_column(2, "genres", empty).set_column(4, "tags", empty), MULTI)
    x = inputs_of(raw)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), eager(*x), rtol=0, atol=1e-5)


def test_export_example_avoids_sizes_zero_and_one(eager):
    raw = RawBatch.from_arrow(shard_batch(1, seed=9, max_len=0), MULTI)  # one row, empty lists
    x = inputs_of(raw)
    ex = eager.export_example(x)
    assert ex[0].shape[0] == ex[4]["genres_lengths"].shape[0] == 2 and torch.equal(ex[0][1], x[0][0])
    for n in ("genres", "tags"):
        assert ex[4][n].shape[0] == int(ex[4][n + "_lengths"].sum()) == 2
    full = inputs_of(RawBatch.from_arrow(shard_batch(8, seed=10, max_len=3).set_column(
        2, "genres", pa.array([[1, 2]] * 8, pa.list_(pa.int64()))), MULTI))
    assert eager.export_example(full)[4] is full[4]  # nothing to pad: traced as given


def test_saved_model_serves_through_the_pyfunc_loader(tmp_path, eager, compiled):
    """What the registered pyfunc runs (recforge.recom.serving.load_predictor on the saved file): a request keyed
    by the column names; lengths that do not add up are refused."""
    path = compiled.save(tmp_path / "inference.pt2")
    predict = load_predictor(str(path), {"backend": "export"})
    x = inputs_of(RawBatch.from_arrow(shard_batch(9, seed=7), MULTI))
    request = {n: t.numpy() for n, t in zip(["dense", "dense_valid", "sparse", "sparse_valid"], x, strict=False)}
    request |= {k: v.numpy() for k, v in x[4].items()}
    with torch.no_grad():
        want = eager(*x)
    torch.testing.assert_close(torch.as_tensor(predict(request)), want, rtol=0, atol=1e-5)
    captured = {("jagged_" + k if k in JAGGED_KEYS else k): v for k, v in request.items()}
    torch.testing.assert_close(torch.as_tensor(predict(captured)), want, rtol=0, atol=1e-5)
    bad = {**request, "tags_lengths": request["tags_lengths"] + 1}
    with pytest.raises(ValueError, match="list column 'tags': lengths"):
        predict(bad)
    with pytest.raises(KeyError, match="genres_lengths"):
        predict({k: v for k, v in request.items() if k != "genres_lengths"})


def test_a_schema_without_list_columns_keeps_four_inputs():
    ds = load_dataset("criteo_kaggle")
    plan = schema_plan(ds, 100)
    pre = PreprocessModule(plan, ds)
    assert pre.list_columns == [] and pre.jagged_input_names() == []
    model = build_dlrm(ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1]), plan.tables(),
                       len(plan.dense_features()), "cpu")
    inf = InferenceModule(pre, model).eval()
    assert inf.raw_input_names() == ["dense", "dense_valid", "sparse", "sparse_valid"]
    x = (torch.zeros(3, 13, dtype=torch.int64), torch.ones(3, 13, dtype=torch.bool),
         torch.arange(78).view(3, 26), torch.ones(3, 26, dtype=torch.bool))
    low = inf.lowered()
    assert inf.dynamic_shapes_for(x) is None and low.export_example(x) == x
    with torch.no_grad():
        out = pre(*x)
        torch.testing.assert_close(low(*x), inf(*x), rtol=0, atol=1e-6)
    assert len(out) == 2 and out[1].shape == (3, 26)  # (dense, ids): the form compiled artifacts were built on


def test_holdout_inputs_carry_the_list_columns(tmp_path):
    schema = tmp_path / "clicks_multi.yaml"
    schema.write_text(yaml.safe_dump(SCHEMA))
    ctx = RunContext.create("multi", PipelineConfig(dataset_schema=str(schema), rows_per_day=300),
                            home=tmp_path / "home")
    landing = tmp_path / "day.parquet"
    pq.write_table(pa.Table.from_batches([shard_batch(300, seed=8)]), landing)
    manifest = ingest([landing], MULTI, tmp_path / "holdout", rows_per_shard=128, max_bad_fraction=0.0)
    split = SplitOutputs(manifest_dir=str(tmp_path / "holdout"), rows=manifest.total_rows, quarantined=0,
                         shards=len(manifest.shards))
    StageWriter(ctx, "ingest").commit(IngestOutputs(train=split, holdout=split, rows_ingested=2 * split.rows,
                                                    rows_quarantined=0))
    assert len(_holdout_inputs(ctx, 200)) == 4  # no list columns asked for: today's four inputs
    dense, _, sparse, _, jagged = _holdout_inputs(ctx, 200, ["genres", "tags"])
    assert dense.shape[0] == sparse.shape[0] == 200 and list(jagged) == JAGGED_KEYS
    want = RawBatch.from_arrow(pa.Table.from_batches([shard_batch(300, seed=8)]).slice(0, 200).to_batches()[0],
                               MULTI)
    for n in ("genres", "tags"):
        assert torch.equal(jagged[n + "_lengths"], want.jagged[n].lengths)
        assert torch.equal(jagged[n], want.jagged[n].values)
