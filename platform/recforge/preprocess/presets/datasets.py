"""Dataset schemas the RAP plan presets read (built here, not in recforge.config: they are plan workloads).

Plans 0 and 1 read the Criteo schema (13 dense I1..I13, 26 sparse C1..C26). RAP's synthetic plans 2 and 3 widen
it: RAP's loader makes int_i a copy of int_{i mod 13} and cat_i a copy of cat_{i mod 26}, so column i here takes
the Criteo column's missing rate and cardinality the same way.
"""
from __future__ import annotations

from recforge.config import (
    CRITEO_DENSE_MISSING,
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_SPARSE_MISSING,
    DatasetConfig,
    DenseFeature,
    SparseFeature,
    criteo_kaggle_dataset,
)

# Criteo Terabyte (1TB click logs) table sizes as TorchRec's DLRM example and RAP's plan 1 use them (177,944,275 rows).
CRITEO_TERABYTE_CARDINALITIES = [
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10, 2209, 11267,
    128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
]


def criteo_terabyte_dataset() -> DatasetConfig:
    ds = criteo_kaggle_dataset()
    return DatasetConfig(
        name="criteo_terabyte",
        dense=ds.dense,
        sparse=[SparseFeature(name=f.name, cardinality=c, missing_rate=f.missing_rate)
                for f, c in zip(ds.sparse, CRITEO_TERABYTE_CARDINALITIES)],
    )


def rap_synthetic_dataset(num_dense: int, num_sparse: int) -> DatasetConfig:
    """num_dense dense I1.. and num_sparse sparse C1.. columns, cycling through Criteo Kaggle's statistics."""
    return DatasetConfig(
        name=f"rap_{num_dense}d_{num_sparse}s",
        dense=[DenseFeature(name=f"I{i + 1}", missing_rate=CRITEO_DENSE_MISSING[i % 13]) for i in range(num_dense)],
        sparse=[
            SparseFeature(name=f"C{i + 1}", cardinality=CRITEO_KAGGLE_CARDINALITIES[i % 26],
                          missing_rate=CRITEO_SPARSE_MISSING[i % 26])
            for i in range(num_sparse)
        ],
    )


def rap_plan2_dataset() -> DatasetConfig:
    return rap_synthetic_dataset(26, 52)


def rap_plan3_dataset() -> DatasetConfig:
    return rap_synthetic_dataset(52, 104)
