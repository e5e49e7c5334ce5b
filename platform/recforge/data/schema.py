"""The "raw typed" Arrow schema of a dataset: what ingest writes and every later stage reads (by column name).

Column order: the label, then the dense columns, then the categorical and multi_hot columns (in file order),
then the timestamp if the dataset has one; ignore columns are not stored. For the Criteo layout this is the
file order. Types:

- label: int8 not null (1 for a positive raw value, 0 for a negative one);
- dense: int64 (dtype int) or float64 (dtype float), nullable;
- categorical: int64, nullable: hex32 as its unsigned 32-bit value, hex64's 64 bits as a signed int64, int as is,
  string as `string_id` (xxh3_64 of the UTF-8 bytes, signed; docs/data.md "String ids");
- multi_hot: list<int64> (an empty field is an empty list);
- timestamp: timestamp[s, tz=UTC].
"""
from __future__ import annotations

import pyarrow as pa

from recforge.config import DatasetConfig
from recforge.config.datasets import DenseFeature, LabelColumn, MultiHotFeature, SparseFeature, TimestampColumn

LABEL_TYPE = pa.int8()
DENSE_TYPE = pa.int64()
DENSE_FLOAT_TYPE = pa.float64()
SPARSE_TYPE = pa.int64()
MULTI_HOT_TYPE = pa.list_(pa.int64())
TIMESTAMP_TYPE = pa.timestamp("s", tz="UTC")


def stored_columns(dataset: DatasetConfig) -> list[LabelColumn | DenseFeature | SparseFeature | TimestampColumn]:
    """The column specs that are stored, in schema order (see the module docstring)."""
    ts = dataset.timestamp
    return [dataset.label_column, *dataset.dense, *dataset.sparse, *([ts] if ts is not None else [])]


def column_names(dataset: DatasetConfig) -> list[str]:
    """The stored columns' names in schema order (for the Criteo layout: every column in file order)."""
    return [c.name for c in stored_columns(dataset)]


def column_type(spec: LabelColumn | DenseFeature | SparseFeature | TimestampColumn) -> pa.DataType:
    if isinstance(spec, LabelColumn):
        return LABEL_TYPE
    if isinstance(spec, DenseFeature):
        return DENSE_FLOAT_TYPE if spec.dtype == "float" else DENSE_TYPE
    if isinstance(spec, MultiHotFeature):
        return MULTI_HOT_TYPE
    if isinstance(spec, SparseFeature):
        return SPARSE_TYPE
    return TIMESTAMP_TYPE


def arrow_schema(dataset: DatasetConfig) -> pa.Schema:
    return pa.schema([pa.field(c.name, column_type(c), nullable=not isinstance(c, LabelColumn))
                      for c in stored_columns(dataset)])


def empty_batch(dataset: DatasetConfig) -> pa.RecordBatch:
    schema = arrow_schema(dataset)
    return pa.RecordBatch.from_arrays([pa.array([], type=f.type) for f in schema], schema=schema)
