"""Massive-column models like RECom's E and F (paper Table 1; AlibabaResearch/recom examples/python/dlrm.py).

A ``FamilySpec`` says how many columns of each kind; ``build_model`` makes a ``ColumnModel``:
one submodule per column (``model.embedding.columns[name]``), concatenated, then a bottom MLP over the
dense features and a top MLP over [bottom(dense), embeddings] -> click probability [B].

Presets follow the paper's synthetic models: E = 880 bucketized + 50 int-hash + 50 string-hash + 15
multi-hot + 5 large multi-hot columns (sum of dims 8,120), F = 1000/90/100/7/3 (1,200 columns, 9,672).
Per-column sizes vary with the seed, as they do in production models (boundaries, rows, combiners).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from recforge.recom.family.columns import (
    BucketizedColumn,
    IntHashColumn,
    MultiHotColumn,
    RawIdColumn,
    SafeMultiHotColumn,
    StringHashColumn,
)

KINDS = ("bucketized", "int_hash", "string_hash", "multi_hot", "large_multi_hot", "raw_id")


@dataclass(frozen=True)
class FamilySpec:
    bucketized: int = 880
    int_hash: int = 50
    string_hash: int = 50
    multi_hot: int = 15
    large_multi_hot: int = 5
    raw_id: int = 0  # identity ids with an out-of-vocabulary guard (not in the paper's models)
    num_dense: int = 32
    bottom: tuple[int, ...] = (32,)
    top: tuple[int, ...] = (1024, 1024, 128)
    buckets: int = 100  # boundaries per bucketized column (about; varies per column)
    small_rows: int = 100
    mid_rows: int = 10_000
    large_rows: int = 1 << 23  # 2**23 x 32 floats = 1 GiB per table, as in the paper
    dims: tuple[int, ...] = (8,)  # drawn per small column
    large_dim: int = 32
    multi_hot_combiner: str = "sum"
    safe_fraction: float = 0.5  # multi-hot columns written as TF's safe_embedding_lookup_sparse port
    vary: bool = True  # per-column sizes drawn around the nominal ones
    seed: int = 0

    def __post_init__(self):
        for kind in KINDS:
            if getattr(self, kind) < 0:
                raise ValueError(f"{kind}: column count must be >= 0, got {getattr(self, kind)}")
        for name in ("buckets", "small_rows", "mid_rows", "large_rows", "large_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.dims or min(self.dims) < 1:
            raise ValueError(f"dims: need at least one positive dim, got {self.dims}")
        if not 0.0 <= self.safe_fraction <= 1.0:
            raise ValueError(f"safe_fraction: must be in [0, 1], got {self.safe_fraction}")

    @property
    def num_columns(self) -> int:
        return sum(getattr(self, k) for k in KINDS)


PRESETS: dict[str, FamilySpec] = {
    "E": FamilySpec(),
    "F": FamilySpec(bucketized=1000, int_hash=90, string_hash=100, multi_hot=7, large_multi_hot=3,
                    top=(2048, 1024, 1024, 512)),
}


def preset(name: str, **overrides) -> FamilySpec:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def scaled(spec: FamilySpec, num_columns: int) -> FamilySpec:
    """The same mix of column kinds at ``num_columns`` columns (largest-remainder rounding)."""
    if num_columns < 1:
        raise ValueError(f"num_columns must be >= 1, got {num_columns}")
    counts = {k: getattr(spec, k) for k in KINDS}
    total = sum(counts.values())
    if total == 0:
        raise ValueError("cannot scale a spec with no columns")
    exact = {k: c * num_columns / total for k, c in counts.items()}
    out = {k: math.floor(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - out[k], reverse=True)[: num_columns - sum(out.values())]:
        out[k] += 1
    return dataclasses.replace(spec, **out)


class EmbeddingLayer(nn.Module):
    """All columns, concatenated in order: features dict -> float32[B, sum of dims]."""

    def __init__(self, columns: dict[str, nn.Module]):
        super().__init__()
        self.columns = nn.ModuleDict(columns)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        parts = []
        for name, column in self.columns.items():
            if getattr(column, "kind", "") in ("multi_hot", "safe_multi_hot"):
                parts.append(column(features[name], features[f"{name}_lengths"]))
            else:
                parts.append(column(features[name]))
        return torch.cat(parts, dim=1)

    @property
    def output_dim(self) -> int:
        return sum(_column_dim(c) for c in self.columns.values())


def _column_dim(column: nn.Module) -> int:
    for attr in ("bag", "embedding"):
        if hasattr(column, attr):
            return getattr(column, attr).embedding_dim
    return column.get_parameter("weight").shape[1]


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
    return nn.Sequential(*layers)


class ColumnModel(nn.Module):
    """features -> sigmoid(top([bottom(dense), embedding(features)])) as float32[B]."""

    def __init__(self, spec: FamilySpec, embedding: EmbeddingLayer):
        super().__init__()
        self.spec = spec
        self.embedding = embedding
        self.bottom = mlp([spec.num_dense, *spec.bottom])
        width = (spec.bottom[-1] if spec.bottom else spec.num_dense) + embedding.output_dim
        self.top = mlp([width, *spec.top])
        self.head = nn.Linear(spec.top[-1] if spec.top else width, 1)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        sparse = self.embedding(features)
        dense = self.bottom(features["dense"])
        logits = self.head(self.top(torch.cat([dense, sparse], dim=1)))
        return torch.sigmoid(logits).squeeze(-1)


@dataclass
class _Draw:
    gen: torch.Generator
    spec: FamilySpec
    names: dict[str, int] = field(default_factory=dict)

    def rows(self, nominal: int) -> int:
        if not self.spec.vary:
            return nominal
        lo, hi = max(2, nominal // 2), max(3, nominal * 2)
        return int(torch.randint(lo, hi, (1,), generator=self.gen))

    def dim(self) -> int:
        dims = self.spec.dims
        return dims[int(torch.randint(0, len(dims), (1,), generator=self.gen))]

    def salt(self) -> int:
        return int(torch.randint(0, 1 << 30, (1,), generator=self.gen))

    def boundaries(self) -> Tensor:
        k = self.spec.buckets
        if self.spec.vary:
            k = max(1, int(torch.randint(max(1, k // 2), k * 2 + 1, (1,), generator=self.gen)))
            steps = torch.rand(k, generator=self.gen) * 9.0 + 1.0  # strictly increasing, uneven gaps
            return torch.cumsum(steps, 0) - 5.0 * k * 0.5
        return torch.arange(k, dtype=torch.float32) * 5.0  # the paper's 0, 5, 10, ...


def build_columns(spec: FamilySpec) -> dict[str, nn.Module]:
    draw = _Draw(torch.Generator().manual_seed(spec.seed), spec)
    cols: dict[str, nn.Module] = {}
    for i in range(spec.bucketized):
        cols[f"bucketized_{i}"] = BucketizedColumn(draw.boundaries(), draw.dim(), combiner="mean")
    for i in range(spec.int_hash):
        cols[f"int_hash_{i}"] = IntHashColumn(draw.rows(spec.small_rows), draw.dim())
    for i in range(spec.string_hash):
        cols[f"string_hash_{i}"] = StringHashColumn(draw.rows(spec.mid_rows), draw.dim(), salt=draw.salt())
    n_safe = round(spec.multi_hot * spec.safe_fraction)
    for i in range(spec.multi_hot):
        cls = SafeMultiHotColumn if i < n_safe else MultiHotColumn
        combiner = spec.multi_hot_combiner
        if spec.vary and i % 3 == 2:
            combiner = "mean" if combiner == "sum" else "sum"
        cols[f"multi_hot_{i}"] = cls(draw.rows(spec.mid_rows), draw.dim(), combiner=combiner, salt=draw.salt())
    for i in range(spec.large_multi_hot):
        cols[f"large_multi_hot_{i}"] = MultiHotColumn(spec.large_rows, spec.large_dim, combiner="sum",
                                                      salt=draw.salt())
    for i in range(spec.raw_id):
        cols[f"raw_id_{i}"] = RawIdColumn(draw.rows(spec.small_rows), draw.dim(), oov="zero")
    return cols


def build_model(spec: FamilySpec) -> ColumnModel:
    """A ColumnModel in eval mode with weights drawn from ``spec.seed``."""
    torch.manual_seed(spec.seed)
    return ColumnModel(spec, EmbeddingLayer(build_columns(spec))).eval()
