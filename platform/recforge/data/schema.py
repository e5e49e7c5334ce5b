"""The "raw typed" Arrow schema of a dataset: what ingest writes and every later stage reads.

Column order is the dataset order: label, dense columns, sparse columns.
label: int8 not null; dense: int64 nullable; sparse: int64 nullable (32-bit hex parsed as unsigned).
"""
from __future__ import annotations

import pyarrow as pa

from recforge.config import DatasetConfig

LABEL_TYPE = pa.int8()
DENSE_TYPE = pa.int64()
SPARSE_TYPE = pa.int64()


def column_names(dataset: DatasetConfig) -> list[str]:
    """All raw columns in file order."""
    return [dataset.label, *dataset.dense_names, *dataset.sparse_names]


def arrow_schema(dataset: DatasetConfig) -> pa.Schema:
    fields = [pa.field(dataset.label, LABEL_TYPE, nullable=False)]
    fields += [pa.field(n, DENSE_TYPE, nullable=True) for n in dataset.dense_names]
    fields += [pa.field(n, SPARSE_TYPE, nullable=True) for n in dataset.sparse_names]
    return pa.schema(fields)


def empty_batch(dataset: DatasetConfig) -> pa.RecordBatch:
    schema = arrow_schema(dataset)
    return pa.RecordBatch.from_arrays([pa.array([], type=f.type) for f in schema], schema=schema)
