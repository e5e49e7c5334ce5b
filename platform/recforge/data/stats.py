"""Per-column statistics of an ingested dataset (the Parquet shards of a manifest), for drift checks and the page.

Streams the shards one row group and one column at a time, so memory stays flat whatever the day's size. Distinct
counts: exact up to EXACT_DISTINCT values, past that Apache DataSketches' HLL estimate (relative standard error
1.04 / sqrt(2**HLL_LG_K), about 0.8 %). Design notes: docs/data.md#column-statistics-and-drift.
"""
from __future__ import annotations

import math
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datasketches import hll_sketch
from pydantic import BaseModel, ConfigDict, Field

from recforge.data.errors import DataError
from recforge.data.manifest import Manifest

STATS_NAME = "stats.json"
HLL_LG_K = 14  # 2**14 buckets: relative standard error 0.81 %
EXACT_DISTINCT = 4096  # a column with at most this many distinct values is counted exactly

_TICKS_PER_S = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}

Role = Literal["label", "dense", "categorical", "multi_hot", "timestamp", "other"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class ColumnStats(_Record):
    """One column over every row of the dataset. Missing: null, NaN (float columns), or an empty / null list."""

    name: str
    role: Role
    arrow_type: str
    rows: int = Field(ge=0)
    missing: int = Field(ge=0)
    missing_rate: float = Field(ge=0, le=1, description="missing / rows (0 for no rows)")
    distinct: int = Field(ge=0, description="distinct non-missing values (list columns: of the values in the lists)")
    distinct_exact: bool = Field(description="counted exactly; else the HLL estimate")
    distinct_lower: int | None = Field(None, description="HLL estimates: lower bound at 2 standard deviations")
    distinct_upper: int | None = Field(None, description="HLL estimates: upper bound at 2 standard deviations")
    min: float | None = Field(None, description="label, dense and timestamp (epoch seconds) columns")
    max: float | None = None
    mean: float | None = Field(None, description="label and dense columns")
    std: float | None = Field(None, description="population standard deviation, label and dense columns")
    positive_rate: float | None = Field(None, description="label column: share of rows with a label > 0")
    mean_length: float | None = Field(None, description="list columns: mean values per row (a missing list is 0)")


class DatasetStats(_Record):
    dataset: str
    manifest_dir: str
    rows: int = Field(ge=0)
    shards: int = Field(ge=0)
    day: str | None = Field(None, description="the data day these rows are (set by the caller)")
    computed_at: str = Field(description="UTC, ISO 8601")
    columns: dict[str, ColumnStats] = Field(description="in the shards' column order")

    def save(self, path: str | Path) -> Path:
        """Write as JSON through a temp file and a rename (a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> DatasetStats:
        return cls.model_validate_json(Path(path).read_text())


def column_roles(dataset: Any) -> dict[str, Role]:
    """Column name -> role from a DatasetConfig (label, dense, sparse with .multi_hot, timestamp)."""
    roles: dict[str, Role] = {dataset.label: "label"}
    for name in dataset.dense_names:
        roles[name] = "dense"
    for spec in dataset.sparse:
        roles[spec.name] = "multi_hot" if getattr(spec, "multi_hot", False) else "categorical"
    ts = getattr(dataset, "timestamp", None)
    if ts is not None:
        roles[ts.name] = "timestamp"
    return roles


class _Accumulator:
    """Running statistics of one column, merged one row-group chunk at a time."""

    def __init__(self, name: str, role: Role, arrow_type: Any):
        self.name, self.role, self.arrow_type = name, role, arrow_type
        self.rows = self.missing = 0
        self.hll = hll_sketch(HLL_LG_K)
        self.exact: set[Any] | None = set()
        self.count = 0  # non-missing numeric values
        self.mean = self.m2 = 0.0
        self.min: float | None = None
        self.max: float | None = None
        self.positives = 0
        self.list_values = 0

    def add(self, chunk: Any) -> None:
        if isinstance(chunk, pa.ChunkedArray):
            chunk = chunk.combine_chunks()
        self.rows += len(chunk)
        if pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
            lengths = pc.fill_null(pc.list_value_length(chunk), 0)
            self.missing += int(pc.sum(pc.equal(lengths, 0)).as_py() or 0)
            self.list_values += int(pc.sum(lengths).as_py() or 0)
            values = pc.list_flatten(chunk).drop_null()
        else:
            values = chunk
            if pa.types.is_floating(values.type):
                values = pc.if_else(pc.is_nan(values), pa.scalar(None, values.type), values)
            self.missing += values.null_count
            values = values.drop_null()
        scale = 1.0  # timestamps: ticks per second (Parquet stores timestamp[s] as milliseconds)
        if pa.types.is_timestamp(values.type):
            scale = _TICKS_PER_S[values.type.unit]
            values = values.cast(pa.int64())
        elif pa.types.is_date(values.type) or pa.types.is_boolean(values.type):
            values = values.cast(pa.int32())
        self._distinct(values)
        if self.role in ("label", "dense", "timestamp") and len(values) and (
                pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
            x = values.to_numpy(zero_copy_only=False).astype(np.float64, copy=False) / scale
            self._moments(x)
            if self.role == "label":
                self.positives += int(np.count_nonzero(x > 0))

    def _distinct(self, values: Any) -> None:
        uniq = pc.unique(values).to_pylist()
        for v in uniq:
            self.hll.update(v)
        if self.exact is not None:
            self.exact.update(uniq)
            if len(self.exact) > EXACT_DISTINCT:
                self.exact = None

    def _moments(self, x: Any) -> None:
        """Chan et al.'s pairwise update of count, mean and the sum of squared deviations."""
        n, mean = x.size, float(x.mean())
        m2 = float(((x - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total
        lo, hi = float(x.min()), float(x.max())
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)

    def result(self) -> ColumnStats:
        exact = self.exact is not None
        numeric = self.count > 0
        is_list = self.role == "multi_hot" or str(self.arrow_type).startswith(("list", "large_list"))
        return ColumnStats(
            name=self.name, role=self.role, arrow_type=str(self.arrow_type), rows=self.rows, missing=self.missing,
            missing_rate=self.missing / self.rows if self.rows else 0.0,
            distinct=len(self.exact) if self.exact is not None else int(round(self.hll.get_estimate())),
            distinct_exact=exact,
            distinct_lower=None if exact else int(math.floor(self.hll.get_lower_bound(2))),
            distinct_upper=None if exact else int(math.ceil(self.hll.get_upper_bound(2))),
            min=self.min if numeric else None, max=self.max if numeric else None,
            mean=self.mean if numeric and self.role != "timestamp" else None,
            std=math.sqrt(self.m2 / self.count) if numeric and self.role != "timestamp" else None,
            positive_rate=self.positives / self.count if numeric and self.role == "label" else None,
            mean_length=self.list_values / self.rows if is_list and self.rows else None,
        )


def compute_column_stats(manifest_dir: str | Path, day: str | None = None) -> DatasetStats:
    """Statistics of every column of the manifest's shards, read one row group and one column at a time.

    A shard that is missing or not readable Parquet is a DataError naming the shard (and the row group)."""
    manifest = Manifest.load(manifest_dir)
    roles = column_roles(manifest.dataset)
    acc: dict[str, _Accumulator] = {}
    for i, shard in enumerate(manifest.shards):
        path = manifest.shard_path(i)
        try:
            pf = pq.ParquetFile(path)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"shard {shard.path} is not readable Parquet: {exc}", path=path) from exc
        with pf:
            for field in pf.schema_arrow:
                if field.name not in acc:
                    acc[field.name] = _Accumulator(field.name, roles.get(field.name, "other"), field.type)
            for g in range(pf.metadata.num_row_groups):
                for name in pf.schema_arrow.names:
                    try:
                        chunk = pf.read_row_group(g, columns=[name], use_threads=False).column(0)
                    except (OSError, ValueError) as exc:
                        raise DataError(f"shard {shard.path}: cannot read: {exc}", path=path, row_group=g,
                                        column=name) from exc
                    acc[name].add(chunk)
    return DatasetStats(
        dataset=manifest.dataset.name, manifest_dir=str(manifest.dir), rows=manifest.total_rows,
        shards=len(manifest.shards), day=day, computed_at=datetime.now(UTC).isoformat(timespec="seconds"),
        columns={name: a.result() for name, a in acc.items()},
    )
