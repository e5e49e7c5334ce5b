"""Dataset schemas: the columns of a raw day file, and the shipped presets (Criteo Kaggle and Terabyte, a wide
synthetic schema, and the schemas RAP's synthetic plans 2 and 3 read).

RAP's loader makes int_i a copy of int_(i mod 13) and cat_i a copy of cat_(i mod 26): its synthetic schemas take
Criteo's missing rates and cardinalities the same way.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from recforge.config.base import StrictModel

# Criteo Kaggle (Display Advertising Challenge) categorical cardinalities, C1..C26.
CRITEO_KAGGLE_CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
# Share of missing values per column measured on Criteo Kaggle's day files (rounded).
CRITEO_DENSE_MISSING = [0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.0, 0.04, 0.45, 0.04, 0.77, 0.22]
CRITEO_SPARSE_MISSING = [
    0.0, 0.0, 0.03, 0.03, 0.0, 0.12, 0.0, 0.0, 0.0, 0.03, 0.0, 0.03, 0.0,
    0.0, 0.0, 0.03, 0.0, 0.0, 0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44,
]


class DenseFeature(StrictModel):
    name: str = Field(min_length=1)
    missing_rate: float = Field(0.0, ge=0.0, lt=1.0)


class SparseFeature(StrictModel):
    name: str = Field(min_length=1)
    cardinality: int = Field(ge=1, description="distinct raw values in the source data")
    missing_rate: float = Field(0.0, ge=0.0, lt=1.0)


class DatasetConfig(StrictModel):
    """Schema of a raw day file: label, then dense integer columns, then sparse hex columns."""

    name: str = Field(min_length=1)
    label: str = "label"
    dense: list[DenseFeature]
    sparse: list[SparseFeature] = Field(min_length=1)
    positive_rate: float = Field(0.25, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _unique_names(self) -> DatasetConfig:
        names = [self.label] + [f.name for f in self.dense] + [f.name for f in self.sparse]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"column names must be unique, repeated: {dupes}")
        return self

    @property
    def dense_names(self) -> list[str]:
        return [f.name for f in self.dense]

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def num_fields(self) -> int:
        return 1 + len(self.dense) + len(self.sparse)


def criteo_kaggle_dataset() -> DatasetConfig:
    return DatasetConfig(
        name="criteo_kaggle",
        dense=[DenseFeature(name=f"I{i + 1}", missing_rate=m) for i, m in enumerate(CRITEO_DENSE_MISSING)],
        sparse=[
            SparseFeature(name=f"C{i + 1}", cardinality=c, missing_rate=m)
            for i, (c, m) in enumerate(zip(CRITEO_KAGGLE_CARDINALITIES, CRITEO_SPARSE_MISSING, strict=True))
        ],
    )


def wide_dataset(num_sparse: int = 400, num_dense: int = 13) -> DatasetConfig:
    """Hundreds of sparse columns, cycling through Criteo's cardinalities and missing rates."""
    n = len(CRITEO_KAGGLE_CARDINALITIES)
    return DatasetConfig(
        name=f"wide{num_sparse}",
        dense=[DenseFeature(name=f"I{i + 1}", missing_rate=CRITEO_DENSE_MISSING[i % 13]) for i in range(num_dense)],
        sparse=[
            SparseFeature(
                name=f"C{i + 1}",
                cardinality=CRITEO_KAGGLE_CARDINALITIES[i % n],
                missing_rate=CRITEO_SPARSE_MISSING[i % n],
            )
            for i in range(num_sparse)
        ],
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
                for f, c in zip(ds.sparse, CRITEO_TERABYTE_CARDINALITIES, strict=True)],
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


DATASET_PRESETS = {"criteo_kaggle": criteo_kaggle_dataset, "wide400": wide_dataset,
                   "criteo_terabyte": criteo_terabyte_dataset, "rap_plan2": rap_plan2_dataset,
                   "rap_plan3": rap_plan3_dataset}

def dataset_preset(name: str) -> DatasetConfig:
    if name not in DATASET_PRESETS:
        raise ValueError(f"dataset_preset: unknown preset {name!r}; choose one of {sorted(DATASET_PRESETS)}")
    return DATASET_PRESETS[name]()
