"""recforge.data.stats: per-column statistics of ingested shards, checked against exact numpy / pyarrow
computations on small shards with several row groups; HLL distinct counts within their documented bound."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from recforge.config import DatasetConfig
from recforge.data.errors import DataError
from recforge.data.manifest import Manifest, ShardInfo, file_sha256
from recforge.data.stats import HLL_LG_K, STATS_NAME, DatasetStats, compute_column_stats

DATASET = DatasetConfig.model_validate({"name": "clicks", "format": "parquet", "columns": [
    {"role": "label", "name": "click"},
    {"role": "dense", "name": "price", "dtype": "float"},
    {"role": "dense", "name": "views", "dtype": "int"},
    {"role": "categorical", "name": "item", "encoding": "int"},
    {"role": "multi_hot", "name": "tags", "encoding": "int", "max_length": 8},
    {"role": "timestamp", "name": "ts", "format": "unix"},
]})


def _table(rng: np.random.Generator, n: int) -> pa.Table:
    price = rng.gamma(2.0, 10.0, n)
    price[rng.random(n) < 0.1] = np.nan  # NaN counts as missing
    price_mask = rng.random(n) < 0.15  # and so do nulls
    views = rng.integers(-5, 1000, n)
    views_mask = rng.random(n) < 0.3
    tags = []
    for _ in range(n):
        r = rng.random()
        tags.append(None if r < 0.1 else [] if r < 0.2 else rng.integers(0, 50, rng.integers(1, 5)).tolist())
    return pa.table({
        "click": pa.array((rng.random(n) < 0.3).astype(np.int8)),
        "price": pa.array(price, mask=price_mask),
        "views": pa.array(views, mask=views_mask),
        "item": pa.array(rng.integers(0, 300, n), mask=rng.random(n) < 0.05),
        "tags": pa.array(tags, type=pa.list_(pa.int64())),
        "ts": pa.array(rng.integers(1_700_000_000, 1_700_086_400, n), type=pa.int64()).cast(pa.timestamp("s", "UTC")),
    })


def write_manifest(directory: Path, tables: list[pa.Table], dataset: DatasetConfig = DATASET,
                   row_group_size: int = 700) -> Path:
    """Shards and a manifest as ingest writes them (several row groups per shard)."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, t in enumerate(tables):
        path = directory / f"part-{i:05d}.parquet"
        pq.write_table(t, path, row_group_size=row_group_size)
        shards.append(ShardInfo(path=path.name, rows=t.num_rows, bytes=path.stat().st_size, sha256=file_sha256(path)))
    Manifest(dataset=dataset, shards=shards, total_rows=sum(t.num_rows for t in tables), quarantined_rows=0,
             sources=["test"]).save(directory)
    return directory


def test_statistics_equal_exact_computations(tmp_path):
    rng = np.random.default_rng(7)
    tables = [_table(rng, 2500), _table(rng, 1800)]
    stats = compute_column_stats(write_manifest(tmp_path / "m", tables), day="2026-01-02")
    whole = pa.concat_tables(tables)
    n = whole.num_rows
    assert (stats.rows, stats.shards, stats.day, stats.dataset) == (n, 2, "2026-01-02", "clicks")
    assert list(stats.columns) == ["click", "price", "views", "item", "tags", "ts"]
    assert {c.name: c.role for c in stats.columns.values()} == {
        "click": "label", "price": "dense", "views": "dense", "item": "categorical", "tags": "multi_hot",
        "ts": "timestamp"}

    label = whole["click"].to_numpy()
    c = stats.columns["click"]
    assert c.missing == 0 and c.distinct == 2 and c.distinct_exact
    assert c.positive_rate == pytest.approx(label.mean()) and c.mean == pytest.approx(label.mean())

    price = whole["price"].to_numpy(zero_copy_only=False)  # nulls come out as NaN
    p = stats.columns["price"]
    kept = price[~np.isnan(price)]
    assert p.missing == n - kept.size and p.missing_rate == pytest.approx((n - kept.size) / n)
    assert (p.min, p.max) == (kept.min(), kept.max())
    assert p.mean == pytest.approx(kept.mean(), rel=1e-12) and p.std == pytest.approx(kept.std(), rel=1e-9)
    assert p.distinct == np.unique(kept).size  # under EXACT_DISTINCT: exact
    assert p.distinct_exact and p.distinct_lower is None

    views = whole["views"].drop_null().to_numpy()
    v = stats.columns["views"]
    assert v.missing == whole["views"].null_count
    assert (v.min, v.max, v.distinct) == (views.min(), views.max(), np.unique(views).size)
    assert v.mean == pytest.approx(views.mean(), rel=1e-12) and v.std == pytest.approx(views.std(), rel=1e-9)

    item = stats.columns["item"]
    assert item.missing == whole["item"].null_count
    assert item.distinct == len(pc.unique(whole["item"].drop_null()))
    assert item.min is None and item.mean is None  # no numeric summary for ids

    tags = whole["tags"].to_pylist()
    t = stats.columns["tags"]
    assert t.missing == sum(1 for x in tags if not x)  # null or empty list
    assert t.mean_length == pytest.approx(sum(len(x or []) for x in tags) / n)
    assert t.distinct == len({v for x in tags for v in x or []})

    ts = whole["ts"].cast(pa.int64()).to_numpy()
    s = stats.columns["ts"]
    assert (s.min, s.max) == (ts.min(), ts.max()) and s.mean is None


def test_distinct_count_of_50k_values_is_the_hll_estimate_within_its_bound(tmp_path):
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.permutation(50_000), rng.integers(0, 50_000, 10_000)]) * 7919 + 11
    table = pa.table({"click": pa.array(np.zeros(values.size, np.int8)), "item": pa.array(values)})
    dataset = DatasetConfig.model_validate({"name": "hll", "format": "parquet", "columns": [
        {"role": "label", "name": "click"}, {"role": "categorical", "name": "item", "encoding": "int"}]})
    stats = compute_column_stats(write_manifest(tmp_path / "m", [table], dataset, row_group_size=8192))
    item = stats.columns["item"]
    assert not item.distinct_exact
    rse = 1.04 / math.sqrt(2**HLL_LG_K)  # DataSketches' HLL relative standard error
    assert abs(item.distinct - 50_000) <= 3 * rse * 50_000
    assert item.distinct_lower is not None and item.distinct_upper is not None
    assert item.distinct_lower <= 50_000 <= item.distinct_upper
    assert stats.columns["click"].distinct == 1 and stats.columns["click"].positive_rate == 0.0


def test_stats_save_and_load_through_a_rename(tmp_path):
    rng = np.random.default_rng(1)
    stats = compute_column_stats(write_manifest(tmp_path / "m", [_table(rng, 300)]))
    path = stats.save(tmp_path / "m" / STATS_NAME)
    assert DatasetStats.load(path) == stats
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp file left


def test_a_corrupt_shard_is_a_data_error_naming_the_shard(tmp_path):
    rng = np.random.default_rng(2)
    directory = write_manifest(tmp_path / "m", [_table(rng, 300), _table(rng, 300)])
    (directory / "part-00001.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match="part-00001.parquet") as info:
        compute_column_stats(directory)
    assert "\n" not in str(info.value)
