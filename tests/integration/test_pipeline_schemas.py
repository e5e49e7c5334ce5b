"""A user's click log end to end: the daily pipeline on a CSV export (header, ignored id, label not first, an hour
timestamp, string / int categoricals, a float and an int dense column, a multi-hot tag list) with no hand-written
plan, and a Parquet export with a multi-hot list column through ingest, statistics and RAP's fused executor.
Criteo (the default schema) runs through every other pipeline test."""
import shutil
from datetime import date
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from recforge.config import PipelineConfig
from recforge.data.shards import open_manifest, read_rows
from recforge.pipelines import landing
from recforge.pipelines.context import RunContext
from recforge.pipelines.runner import run_all
from recforge.pipelines.stages.data import generate, ingest
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import TorchExecutor, make_executor
from recforge.preprocess.planning.plan import Plan, schema_plan

DATA = Path(__file__).resolve().parents[1] / "data"
RUN_DAY = date(2026, 3, 4)


def _ctx(home: Path, key: str, **config) -> RunContext:
    cfg = PipelineConfig.model_validate(config)
    return RunContext.create(key, cfg, home=home, data_day=landing.first_day(RUN_DAY, cfg))


def test_csv_click_log_runs_the_daily_pipeline_with_the_derived_plan(recforge_home, tmp_path):
    zone = tmp_path / "landing"
    zone.mkdir()
    for day in ("2026-03-04", "2026-03-05"):  # the run's day and the held-out next day
        shutil.copy(DATA / "clicks_sample.csv", zone / f"clicks_{day}.csv")
    ctx = _ctx(recforge_home, "csv", dataset_schema=str(DATA / "schemas" / "clicks_csv.yaml"),
               source_uri=str(zone / "clicks_{ds}.csv"), max_bad_fraction=0.05, rows_per_shard=64, table_cap=512,
               preprocessing="inline", checkpoint={"every_steps": 0, "flash": False},
               resources={"policy": "static", "workers": 1}, train={"batch_size": 32},
               model={"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 1]})
    out = run_all(ctx)
    ing = out["ingest"]
    assert (ing.train.rows, ing.train.quarantined) == (195, 5) and ing.holdout.rows == 195
    assert ing.stats is not None and {c.name for c in ing.stats.columns} >= {"site_id", "tags", "price"}
    plan = Plan.load(out["plan_resources"].plan_path)  # derived from the schema's roles: nobody wrote it
    assert plan == schema_plan(ctx.config.dataset(), 512)
    chains = {f.name: [s.op for s in f.ops] for f in plan.features}
    assert chains["impressions"] == ["fill_null", "log1p"] and chains["price"] == ["fill_null", "clamp", "log1p"]
    assert chains["site_id"] == ["fill_null", "sigrid_hash", "firstx"] and chains["tags"][-1] == "firstx"
    assert sum(out["train"].samples_trained) == 195
    assert 0.0 <= out["evaluate"].auc <= 1.0 and out["evaluate"].rows == 195
    assert out["compile"].report.within_tolerance
    report = out["compile"].report  # the default backend: AOTInductor where a C++ toolchain builds it
    assert report.model_extra["requested_backend"] == "auto" and report.backend in ("aoti", "export"), report
    assert (report.backend == "export") == ("backend_fallback" in report.model_extra), report
    assert out["publish"].version


def _parquet_schema(tmp_path: Path) -> Path:
    spec = {"name": "clicks_parquet", "format": "parquet", "columns": [
        {"name": "click", "role": "label"},
        {"name": "hour", "role": "timestamp", "format": "unix"},
        {"name": "price", "role": "dense", "dtype": "float"},
        {"name": "visits", "role": "dense"},
        {"name": "site_id", "role": "categorical", "encoding": "string", "cardinality": 1000},
        {"name": "tags", "role": "multi_hot", "encoding": "int", "max_length": 3},
        {"name": "export_batch", "role": "ignore"},
    ]}
    path = tmp_path / "clicks_parquet.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_parquet_export_with_a_multi_hot_column(recforge_home, tmp_path):
    zone = tmp_path / "landing"
    zone.mkdir()
    n = 600
    table = pa.table({
        "click": pa.array([i % 3 == 0 for i in range(n)]),
        "hour": pa.array([1772582400 + 60 * i for i in range(n)], pa.int64()),
        "price": pa.array([None if i % 7 == 0 else i * 0.5 for i in range(n)], pa.float64()),
        "visits": pa.array([i % 11 for i in range(n)], pa.int64()),
        "site_id": pa.array([f"site{i % 37}" for i in range(n)]),
        "tags": pa.array([[i % 5, i % 13, i % 17, i % 19][: i % 5] for i in range(n)], pa.list_(pa.int64())),
        "export_batch": pa.array(["b1"] * n),
    })
    for day in ("2026-03-04", "2026-03-05"):
        pq.write_table(table, zone / f"{day}.parquet", row_group_size=200)
    ctx = _ctx(recforge_home, "parquet", dataset_schema=str(_parquet_schema(tmp_path)),
               source_uri=str(zone / "{ds}.parquet"), rows_per_shard=250, table_cap=256)
    generate(ctx)
    out = ingest(ctx)
    assert out.train.rows == n and out.train.quarantined == 0
    manifest_dir = out.train.manifest_dir
    assert open_manifest(manifest_dir).total_rows == n
    assert out.stats is not None  # column statistics of the day: the float's nulls, the list column's length
    cols = {c.name: c for c in out.stats.columns}
    assert cols["price"].missing_rate == pytest.approx(sum(i % 7 == 0 for i in range(n)) / n)
    assert cols["tags"].mean_length == pytest.approx(sum(i % 5 for i in range(n)) / n)
    dataset = ctx.config.dataset()
    plan = schema_plan(dataset, ctx.config.table_cap)
    raw = RawBatch.from_arrow(read_rows(manifest_dir, 0, 0, 250), dataset)
    assert raw.dense.dtype.is_floating_point and "tags" in raw.jagged
    dense, kjt = make_executor("fused", plan, dataset)(raw)
    eager_dense, eager_kjt = make_executor("eager", plan, dataset)(raw)
    assert dense.shape == (250, 4) and kjt.keys() == ["site_id", "tags"]
    assert dense[:, 2].tolist() == [-1.0 if i % 7 == 0 else 0.0 for i in range(250)]  # price_missing
    assert kjt["tags"].lengths().tolist() == [min(i % 5, 3) for i in range(250)]
    assert torch.equal(dense, eager_dense) and torch.equal(kjt.values(), eager_kjt.values())
    module_dense, module_kjt = TorchExecutor(plan, dataset)(raw)  # the exportable module: evaluate's and serving's
    assert torch.allclose(module_dense, dense) and torch.equal(module_kjt.values(), kjt.values())
    assert torch.equal(module_kjt.lengths(), kjt.lengths())
