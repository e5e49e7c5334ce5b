"""Dataset schemas: the columns of a raw day file, and the shipped presets (Criteo Kaggle and Terabyte, a wide
synthetic schema, and the schemas RAP's synthetic plans 2 and 3 read).

RAP's loader makes int_i a copy of int_(i mod 13) and cat_i a copy of cat_(i mod 26): its synthetic schemas take
Criteo's missing rates and cardinalities the same way.
"""
from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

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


Role = Literal["label", "dense", "categorical", "multi_hot", "timestamp", "ignore"]
ROLES: tuple[str, ...] = ("label", "dense", "categorical", "multi_hot", "timestamp", "ignore")
Encoding = Literal["hex32", "hex64", "int", "string"]
SCHEMA_DIR = Path(__file__).parent / "schemas"
HASH_HEADROOM = 64  # the schema plan hashes n known values into 64 n rows (<= table_cap): ~1.5% share a row


class LabelColumn(StrictModel):
    """The click label: which raw values mean positive and which negative (any other value is a bad row)."""

    role: Literal["label"] = "label"
    name: str = Field(min_length=1)
    positive: list[str] = Field(default_factory=lambda: ["1"], min_length=1)
    negative: list[str] = Field(default_factory=lambda: ["0"], min_length=1)

    @model_validator(mode="after")
    def _disjoint(self) -> LabelColumn:
        both = sorted(set(self.positive) & set(self.negative))
        if both:
            raise ValueError(f"column {self.name!r}: label values {both} are both positive and negative")
        return self


class DenseFeature(StrictModel):
    """A numeric column: integer counts or floats. The default plan takes log1p of counts (after clip, if set)."""

    role: Literal["dense"] = "dense"
    name: str = Field(min_length=1)
    dtype: Literal["int", "float"] = "int"
    transform: Literal["log1p", "none"] = Field(
        "log1p", description="the default plan's transform: log1p(max(x, 0)) of counts, or the value as is")
    clip: tuple[float, float] | None = Field(None, description="[lo, hi] the default plan clamps the value to first")
    missing_indicator: bool = Field(
        True, description="the default plan adds an input `<name>_missing`: -1 where the value is missing (or "
                          "negative), 0 otherwise, so that a missing count and a count of 0 stay apart")
    missing_rate: float = Field(0.0, ge=0.0, lt=1.0, description="synthetic data only: share of missing values")

    @model_validator(mode="after")
    def _clip_ordered(self) -> DenseFeature:
        if self.clip is not None and not self.clip[0] < self.clip[1]:
            raise ValueError(f"column {self.name!r}: clip needs lo < hi, got {list(self.clip)}")
        return self


class SparseFeature(StrictModel):
    """A categorical column: one id per row, parsed by `encoding` (strings hashed to 64-bit ids, see docs/data.md)."""

    role: Literal["categorical"] = "categorical"
    name: str = Field(min_length=1)
    encoding: Encoding = "hex32"
    cardinality: int | None = Field(
        None, ge=1, description="distinct raw values in the source data, if known: the default plan hashes to "
        "min(cardinality x hash_headroom, table_cap) rows (table_cap when unknown)")
    missing_rate: float = Field(0.0, ge=0.0, lt=1.0, description="synthetic data only: share of missing values")

    @property
    def multi_hot(self) -> bool:
        return False

    def table_rows(self, table_cap: int, headroom: int) -> int:
        """Rows of this column's hashed table: min(cardinality x headroom, table_cap), table_cap when the
        cardinality is unknown. Hashing n values into n rows makes ~63% of them share a row (docs/data.md). No
        default: the schema plan passes HASH_HEADROOM, RAP's plans 1 (as published)."""
        if headroom < 1:
            raise ValueError(f"column {self.name!r}: hash headroom must be >= 1, got {headroom}")
        return min(self.cardinality * headroom, table_cap) if self.cardinality is not None else table_cap


class MultiHotFeature(SparseFeature):
    """A multi-valued categorical column: ids separated by `delimiter` inside the field (Parquet: a list column);
    the default plan keeps the first `max_length` of them."""

    role: Literal["multi_hot"] = "multi_hot"  # type: ignore[assignment]
    delimiter: str = Field("|", min_length=1, max_length=1)
    max_length: int = Field(ge=1, le=4096)

    @property
    def multi_hot(self) -> bool:
        return True


class TimestampColumn(StrictModel):
    """Event time. `format`: a strptime format (e.g. "%Y-%m-%d %H:%M:%S", "%y%m%d%H"), "unix" or "unix_ms";
    times without a zone are UTC. Used to tell which day a row belongs to."""

    role: Literal["timestamp"] = "timestamp"
    name: str = Field(min_length=1)
    format: str = Field(min_length=1)

    @model_validator(mode="after")
    def _format_parses(self) -> TimestampColumn:
        if self.format in ("unix", "unix_ms"):
            return self
        probe = datetime(2026, 11, 3, 14, 0, 0)
        try:
            text = probe.strftime(self.format)
            back = datetime.strptime(text, self.format)
        except ValueError as e:
            raise ValueError(f"column {self.name!r}: timestamp format {self.format!r} does not parse: {e}") from None
        if back.date() != probe.date():
            raise ValueError(f"column {self.name!r}: timestamp format {self.format!r} does not give the date "
                             f"(formats {probe} as {text!r}, which reads back as {back})")
        return self


class IgnoredColumn(StrictModel):
    """A column in the file that is not read (an id, a free-text field)."""

    role: Literal["ignore"] = "ignore"
    name: str = Field(min_length=1)


Column = Annotated[
    LabelColumn | DenseFeature | SparseFeature | MultiHotFeature | TimestampColumn | IgnoredColumn,
    Field(discriminator="role"),
]


def _legacy_columns(data: dict[str, Any]) -> dict[str, Any]:
    """The older constructor form (label name, dense list, sparse list: Criteo's column order) -> `columns`."""
    data = dict(data)
    label = data.pop("label", "label")
    dense = data.pop("dense", [])
    sparse = data.pop("sparse", [])
    if "columns" in data:
        raise ValueError("give either `columns` or label/dense/sparse, not both")

    def as_dict(c: Any, role: str) -> Any:
        if isinstance(c, BaseModel):
            return c
        return {"role": role, **c} if isinstance(c, dict) else c

    data["columns"] = [{"role": "label", "name": label}, *(as_dict(c, "dense") for c in dense),
                       *(as_dict(c, "categorical") for c in sparse)]
    return data


class DatasetConfig(StrictModel):
    """Schema of a raw day file: its format and every column in file order with a role (docs/data.md).

    A YAML file with this structure describes a user's click log; Criteo Kaggle and Terabyte are two shipped
    files (config/schemas/). Text formats read columns by position (and check the header's names when there is
    one); Parquet reads them by name.
    """

    name: str = Field(min_length=1)
    format: Literal["tsv", "csv", "parquet"] = "tsv"
    delimiter: str | None = Field(None, description="field separator of text formats (default: tab / comma)")
    header: bool = Field(False, description="text formats: the first line names the columns")
    quote: str | None = Field(None, description="csv quote character (default '\"' for csv, none for tsv)")
    compression: Literal["auto", "gzip", "none"] = Field(
        "auto", description="auto: gzip when the name ends in .gz or the content starts with gzip's magic bytes")
    columns: list[Column] = Field(min_length=2)
    positive_rate: float = Field(0.25, gt=0.0, lt=1.0, description="synthetic data only: share of positive labels")

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "columns" not in data and ("dense" in data or "sparse" in data or "label" in data):
            data = _legacy_columns(data)
        cols = data.get("columns")
        if isinstance(cols, list):
            for i, c in enumerate(cols):
                if isinstance(c, dict):
                    name = c.get("name", f"#{i}")
                    role = c.get("role")
                    if role is None:
                        raise ValueError(f"column {name!r}: no role; roles: {list(ROLES)}")
                    if role not in ROLES:
                        raise ValueError(f"column {name!r}: unknown role {role!r}; roles: {list(ROLES)}")
        return data

    @model_validator(mode="after")
    def _check(self) -> DatasetConfig:
        names = [c.name for c in self.columns]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"column names must be unique, repeated: {dupes}")
        labels = [c.name for c in self.columns if isinstance(c, LabelColumn)]
        if len(labels) != 1:
            raise ValueError(f"a dataset needs exactly one label column, found {len(labels)}: {labels}")
        stamps = [c.name for c in self.columns if isinstance(c, TimestampColumn)]
        if len(stamps) > 1:
            raise ValueError(f"at most one timestamp column, found {stamps}")
        if not self.sparse:
            raise ValueError("a dataset needs at least one categorical or multi_hot column (the model's embeddings)")
        if self.format == "parquet":
            if self.delimiter is not None or self.header or self.quote is not None:
                raise ValueError("delimiter, header and quote are for tsv/csv; parquet reads columns by name")
        else:
            for field_name, v in (("delimiter", self.delimiter), ("quote", self.quote)):
                if v is not None and len(v) != 1:
                    raise ValueError(f"{field_name} must be one character, got {v!r}")
            if self.delimiter is not None and self.delimiter in ("\n", "\r", self.quote):
                raise ValueError(f"delimiter {self.delimiter!r} cannot be a line break or the quote character")
            for c in self.columns:
                if isinstance(c, MultiHotFeature) and c.delimiter == self.field_delimiter:
                    raise ValueError(f"column {c.name!r}: multi_hot delimiter {c.delimiter!r} is the field delimiter")
        return self

    @classmethod
    def criteo_order(cls, name: str, dense: list[DenseFeature], sparse: list[SparseFeature], label: str = "label",
                     **fields: Any) -> DatasetConfig:
        """Label, then `dense`, then `sparse`: the Criteo column order (the code's synthetic schemas)."""
        return cls(name=name, columns=[LabelColumn(name=label), *dense, *sparse], **fields)

    # ------------------------------------------------------------------------------------------ views by role
    @property
    def label_column(self) -> LabelColumn:
        return next(c for c in self.columns if isinstance(c, LabelColumn))

    @property
    def label(self) -> str:
        return self.label_column.name

    @property
    def dense(self) -> list[DenseFeature]:
        return [c for c in self.columns if isinstance(c, DenseFeature)]

    @property
    def sparse(self) -> list[SparseFeature]:
        """Categorical and multi_hot columns, in file order."""
        return [c for c in self.columns if isinstance(c, SparseFeature)]

    @property
    def timestamp(self) -> TimestampColumn | None:
        return next((c for c in self.columns if isinstance(c, TimestampColumn)), None)

    @property
    def dense_names(self) -> list[str]:
        return [f.name for f in self.dense]

    @property
    def sparse_names(self) -> list[str]:
        return [f.name for f in self.sparse]

    @property
    def field_names(self) -> list[str]:
        """Every column of the file in file order, ignored ones included."""
        return [c.name for c in self.columns]

    @property
    def num_fields(self) -> int:
        return len(self.columns)

    @property
    def field_delimiter(self) -> str:
        if self.delimiter is not None:
            return self.delimiter
        return "," if self.format == "csv" else "\t"

    @property
    def quote_char(self) -> str | None:
        if self.format == "csv":
            return self.quote if self.quote is not None else '"'
        return self.quote

    @property
    def is_criteo_layout(self) -> bool:
        """Label 0/1 first, then int dense, then hex32 categoricals, tab-separated, no header: the fast reader."""
        lab = self.label_column
        return (self.format == "tsv" and self.field_delimiter == "\t" and not self.header and self.quote is None
                and isinstance(self.columns[0], LabelColumn) and lab.positive == ["1"] and lab.negative == ["0"]
                and all(isinstance(c, DenseFeature) and c.dtype == "int" for c in self.columns[1:1 + len(self.dense)])
                and all(type(c) is SparseFeature and c.encoding == "hex32"
                        for c in self.columns[1 + len(self.dense):]))


_FILE_CACHE: dict[tuple[str, int, int], DatasetConfig] = {}  # (resolved path, mtime_ns, size) -> the parsed schema


def load_dataset_file(path: str | Path) -> DatasetConfig:
    """A dataset schema from YAML (or JSON); errors name the file and the field. A file parsed before and not
    changed since (same mtime and size) is not read again: callers get their own copy of the cached schema."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset schema file not found: {path}")
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _FILE_CACHE:
        _FILE_CACHE[key] = _parse_dataset_file(path)
    return _FILE_CACHE[key].model_copy(deep=True)


def _parse_dataset_file(path: Path) -> DatasetConfig:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"dataset schema {path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"dataset schema {path}: expected a mapping with name, format and columns")
    try:
        return DatasetConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"dataset schema {path}: {_describe(e)}") from None


def _describe(err: ValidationError) -> str:
    parts = []
    for d in err.errors():
        loc = list(d["loc"])
        where = ""
        if len(loc) >= 2 and loc[0] == "columns" and isinstance(loc[1], int):
            where = f"columns[{loc[1]}]"
            rest = [str(x) for x in loc[2:] if x not in ROLES]
            where += ("." + ".".join(rest)) if rest else ""
        elif loc:
            where = ".".join(str(x) for x in loc)
        msg = d["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def criteo_kaggle_dataset() -> DatasetConfig:
    """Criteo Kaggle, from the shipped schema file config/schemas/criteo_kaggle.yaml."""
    return load_dataset_file(SCHEMA_DIR / "criteo_kaggle.yaml")


def wide_dataset(num_sparse: int = 400, num_dense: int = 13) -> DatasetConfig:
    """Hundreds of sparse columns, cycling through Criteo's cardinalities and missing rates."""
    n = len(CRITEO_KAGGLE_CARDINALITIES)
    return DatasetConfig.criteo_order(
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
    """Criteo Terabyte, from the shipped schema file config/schemas/criteo_terabyte.yaml."""
    return load_dataset_file(SCHEMA_DIR / "criteo_terabyte.yaml")


def rap_synthetic_dataset(num_dense: int, num_sparse: int) -> DatasetConfig:
    """num_dense dense I1.. and num_sparse sparse C1.. columns, cycling through Criteo Kaggle's statistics."""
    return DatasetConfig.criteo_order(
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
        raise ValueError(f"dataset_schema: unknown preset {name!r}; choose one of {sorted(DATASET_PRESETS)}")
    return DATASET_PRESETS[name]()


def load_dataset(name_or_path: str | Path) -> DatasetConfig:
    """A shipped schema by name (criteo_kaggle, criteo_terabyte, and the generated wide400 / rap_plan2 / rap_plan3)
    or a user's schema file (.yaml / .yml / .json)."""
    key = str(name_or_path)
    if key in DATASET_PRESETS:
        return DATASET_PRESETS[key]()
    if Path(key).suffix in (".yaml", ".yml", ".json"):
        return load_dataset_file(key)
    raise ValueError(f"dataset {key!r} is neither a shipped schema {sorted(DATASET_PRESETS)} nor a "
                     ".yaml/.yml/.json schema file")
