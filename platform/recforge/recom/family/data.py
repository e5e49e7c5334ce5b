"""Request batches for ColumnModels: a dict of raw per-column tensors, jagged columns as values + lengths.

Strings are fingerprinted to int64 before they reach the model (``fingerprint_strings``). PyTorch has no
string tensor, every production PyTorch serving stack (TorchRec KJTs, TorchArrow/Velox's sigrid_hash)
takes int64 ids, and RECom itself runs string work on the host, outside the fused kernel. Byte tensors
would move the same hashing into the model at the price of a padded [nnz, max_len] layout per column.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import Tensor, nn

from recforge.recom.family.columns import JAGGED_KINDS, BucketizedColumn, RawIdColumn

LENGTHS_SUFFIX = "_lengths"


def fingerprint_strings(strings: Iterable[str]) -> Tensor:
    """64-bit BLAKE2b fingerprint of each UTF-8 string, as int64 (the bits read as two's complement)."""
    out = [int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little", signed=True)
           for s in strings]
    return torch.tensor(out, dtype=torch.int64)


def random_strings(n: int, gen: torch.Generator, length: int = 8) -> list[str]:
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    codes = torch.randint(0, len(alphabet), (n, length), generator=gen).tolist()
    return ["".join(alphabet[c] for c in row) for row in codes]


def _columns(model: nn.Module) -> dict[str, nn.Module]:
    layer = getattr(model, "embedding", model)
    columns = getattr(layer, "columns", None)  # an nn.ModuleDict
    if columns is None:
        raise TypeError(f"{type(model).__name__} is neither a ColumnModel nor an EmbeddingLayer")
    return dict(columns.items())


def make_features(model: nn.Module, batch: int, seed: int = 0, *, max_bag: int = 10, empty_rate: float = 0.1,
                  strings: bool = False, num_dense: int | None = None) -> dict[str, Tensor]:
    """A random request of ``batch`` rows for every column of ``model`` (a ColumnModel or its EmbeddingLayer).

    Bucketized inputs span past both ends of each column's boundaries (so buckets 0 and K occur); hashed
    inputs are fingerprints (``strings=True`` fingerprints real random strings, else random int64s: same
    distribution, much faster); jagged rows hold 0..max_bag ids, about ``empty_rate`` of them empty.
    A jagged column never has exactly ``batch`` values, so its length cannot be mistaken for the batch.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    gen = torch.Generator().manual_seed(seed)
    feats: dict[str, Tensor] = {}

    def fingerprints(n: int) -> Tensor:
        if strings:
            return fingerprint_strings(random_strings(n, gen))
        return torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64)

    for name, col in _columns(model).items():
        kind = getattr(col, "kind", None)
        if kind == "bucketized":
            assert isinstance(col, BucketizedColumn)  # the one column of that kind
            b = col.boundaries
            span = float(b[-1] - b[0]) if b.numel() > 1 else 1.0
            lo, hi = float(b[0]) - 0.1 * span - 1.0, float(b[-1]) + 0.1 * span + 1.0
            x = torch.rand(batch, generator=gen) * (hi - lo) + lo
            x[torch.rand(batch, generator=gen) < 0.05] = b[0]  # exact boundary hits: right=False matters
            feats[name] = x
        elif kind == "int_hash":
            feats[name] = torch.randint(-(1 << 40), 1 << 40, (batch,), generator=gen)
        elif kind == "string_hash":
            feats[name] = fingerprints(batch)
        elif kind == "raw_id":
            assert isinstance(col, RawIdColumn)  # the one column of that kind
            n = col.num_rows
            feats[name] = torch.randint(-2, n + 3, (batch,), generator=gen) if col.oov == "zero" else \
                torch.randint(0, n, (batch,), generator=gen)
        elif kind in JAGGED_KINDS:
            lengths = torch.randint(0, max_bag + 1, (batch,), generator=gen)
            lengths[torch.rand(batch, generator=gen) < empty_rate] = 0
            if int(lengths.sum()) == batch:
                lengths[0] += 1
            feats[name] = fingerprints(int(lengths.sum()))
            feats[name + LENGTHS_SUFFIX] = lengths
        else:
            raise TypeError(f"column {name!r}: unknown kind {kind!r}")
    spec = getattr(model, "spec", None)
    dense = num_dense if num_dense is not None else (spec.num_dense if spec is not None else None)
    if dense is not None and hasattr(model, "bottom"):
        feats["dense"] = torch.randn(batch, dense, generator=gen)
    return feats


def batch_of(features: dict[str, Tensor]) -> int:
    """The batch size of a request: the length of every non-jagged input."""
    sizes = {int(t.shape[0]) for k, t in features.items() if not _is_values(k, features)}
    if len(sizes) != 1:
        raise ValueError(f"inputs disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def _is_values(key: str, features: dict[str, Tensor]) -> bool:
    return key + LENGTHS_SUFFIX in features


def select_rows(features: dict[str, Tensor], rows: Tensor | list[int]) -> dict[str, Tensor]:
    """The request made of the given rows (in that order), jagged columns included."""
    rows = torch.as_tensor(rows, dtype=torch.int64)
    out: dict[str, Tensor] = {}
    for key, t in features.items():
        if _is_values(key, features):
            lengths = features[key + LENGTHS_SUFFIX]
            starts = torch.cumsum(lengths, 0) - lengths
            pieces = [t[int(starts[r]): int(starts[r]) + int(lengths[r])] for r in rows.tolist()]
            out[key] = torch.cat(pieces) if pieces else t[:0]
        else:
            out[key] = t.index_select(0, rows)
    return out
