"""Embedding columns written the way users write them: one nn.Module per column, eager PyTorch.

Each column turns one raw feature into ids, guards them, looks them up and pools. Several carry the
"robustness" ops real code carries (a clamp after a bucketize, ``ids >= 0`` after a hash, TensorFlow's
``safe_embedding_lookup_sparse`` ported op for op); the compiler must prove them redundant rather than
be told. Strings arrive pre-hashed as int64 fingerprints (see ``data.fingerprint_strings``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import recforge_kernels  # noqa: F401  (registers torch.ops.recforge.sigrid_hash)

COMBINERS = ("sum", "mean")


def _check_combiner(combiner: str) -> str:
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    return combiner


class BucketizedColumn(nn.Module):
    """float[B] -> bucketize into [0, K] -> (redundant) clamp -> EmbeddingBag over a [B, 1] input."""

    kind = "bucketized"
    boundaries: Tensor  # buffer

    def __init__(self, boundaries: Tensor, dim: int, combiner: str = "mean"):
        super().__init__()
        boundaries = torch.as_tensor(boundaries, dtype=torch.float32)
        if boundaries.dim() != 1 or boundaries.numel() == 0 or not bool((boundaries[1:] > boundaries[:-1]).all()):
            raise ValueError("boundaries must be a non-empty, strictly increasing 1-D sequence")
        self.register_buffer("boundaries", boundaries)
        self.num_buckets = boundaries.numel() + 1
        self.bag = nn.EmbeddingBag(self.num_buckets, dim, mode=_check_combiner(combiner))

    def forward(self, x: Tensor) -> Tensor:
        ids = torch.bucketize(x, self.boundaries)
        ids = ids.clamp(0, self.num_buckets - 1)
        return self.bag(ids.view(-1, 1))


class IntHashColumn(nn.Module):
    """int64[B] -> floor-mod N -> TF-style guard (0 <= id < N, else 0) -> Embedding."""

    kind = "int_hash"

    def __init__(self, num_rows: int, dim: int):
        super().__init__()
        self.num_rows = int(num_rows)
        self.embedding = nn.Embedding(self.num_rows, dim)

    def forward(self, x: Tensor) -> Tensor:
        ids = torch.remainder(x, self.num_rows)
        ids = torch.where((ids >= 0) & (ids < self.num_rows), ids, torch.zeros_like(ids))
        return self.embedding(ids)


class StringHashColumn(nn.Module):
    """int64 string fingerprints[B] -> sigrid_hash into [0, N) -> (redundant) clamp -> Embedding."""

    kind = "string_hash"

    def __init__(self, num_rows: int, dim: int, salt: int = 0):
        super().__init__()
        self.num_rows, self.salt = int(num_rows), int(salt)
        self.embedding = nn.Embedding(self.num_rows, dim)

    def forward(self, fingerprints: Tensor) -> Tensor:
        ids = torch.ops.recforge.sigrid_hash(fingerprints, self.salt, self.num_rows)
        return self.embedding(ids.clamp(0, self.num_rows - 1))


class _HashedBagColumn(nn.Module):
    """A jagged column of fingerprints hashed into a table of ``num_rows`` and pooled with ``combiner``."""

    def __init__(self, num_rows: int, dim: int, combiner: str = "sum", salt: int = 0):
        super().__init__()
        self.num_rows, self.salt, self.combiner = int(num_rows), int(salt), _check_combiner(combiner)
        self.weight = nn.Parameter(torch.randn(self.num_rows, dim) * 0.1)


class MultiHotColumn(_HashedBagColumn):
    """Jagged fingerprints (values[nnz], lengths[B]) -> sigrid_hash -> F.embedding_bag with offsets.

    An empty row pools to zeros (sum and mean alike), PyTorch's EmbeddingBag semantics.
    """

    kind = "multi_hot"

    def forward(self, values: Tensor, lengths: Tensor) -> Tensor:
        ids = torch.ops.recforge.sigrid_hash(values, self.salt, self.num_rows)
        offsets = torch.cumsum(lengths, 0) - lengths
        return F.embedding_bag(ids, self.weight, offsets, mode=self.combiner)


class SafeMultiHotColumn(_HashedBagColumn):
    """TensorFlow's ``safe_embedding_lookup_sparse`` ported op for op (what a migrated model looks like).

    prune ids < 0 -> fill empty rows with id 0 -> unique -> gather -> segment sum (/ count for mean)
    -> zero the rows that were empty. Data-dependent sizes everywhere: eager pays a sync per step.
    """

    kind = "safe_multi_hot"

    def forward(self, values: Tensor, lengths: Tensor) -> Tensor:
        batch = lengths.shape[0]
        ids = torch.ops.recforge.sigrid_hash(values, self.salt, self.num_rows)
        segments = torch.repeat_interleave(torch.arange(batch), lengths, output_size=values.shape[0])
        keep = ids >= 0  # _prune_invalid_ids
        ids, segments = ids[keep], segments[keep]
        counts = torch.zeros(batch, dtype=torch.int64).index_add(0, segments, torch.ones_like(segments))
        empty = counts == 0  # sparse_fill_empty_rows(default_id=0)
        fill_rows = torch.arange(batch)[empty]
        ids = torch.cat([ids, torch.zeros_like(fill_rows)])
        segments = torch.cat([segments, fill_rows])
        unique_ids, inverse = torch.unique(ids, return_inverse=True)
        rows = F.embedding(unique_ids, self.weight)[inverse]
        pooled = torch.zeros(batch, self.weight.shape[1]).index_add(0, segments, rows)
        if self.combiner == "mean":
            filled_counts = torch.zeros(batch).index_add(0, segments, torch.ones(segments.shape[0]))
            pooled = pooled / filled_counts.clamp(min=1).unsqueeze(1)
        return torch.where(empty.unsqueeze(1), torch.zeros_like(pooled), pooled)


class RawIdColumn(nn.Module):
    """int64 ids used as they come. ``oov="zero"`` maps ids outside [0, N) to 0 with two consecutive guards
    (the compiler must keep and merge them); ``oov="error"`` looks them up as is, so an id out of range
    raises IndexError, as nn.Embedding does."""

    kind = "raw_id"

    def __init__(self, num_rows: int, dim: int, oov: str = "zero"):
        super().__init__()
        if oov not in ("zero", "error"):
            raise ValueError(f"oov must be 'zero' or 'error', got {oov!r}")
        self.num_rows, self.oov = int(num_rows), oov
        self.embedding = nn.Embedding(self.num_rows, dim)

    def forward(self, x: Tensor) -> Tensor:
        ids = x
        if self.oov == "zero":
            ids = torch.where(ids >= 0, ids, torch.zeros_like(ids))
            ids = torch.where(ids < self.num_rows, ids, torch.zeros_like(ids))
        return self.embedding(ids)


JAGGED_KINDS = frozenset({MultiHotColumn.kind, SafeMultiHotColumn.kind})
