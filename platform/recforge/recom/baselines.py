"""What a TorchRec user would run instead of RECom: the same model as grouped preprocessing + a fused lookup.

* ``GroupedPreprocess``: every column's id translation, vectorized per kind (all bucketized columns in one
  ``searchsorted`` over padded boundaries, all int-hash columns in one ``remainder``, all string-hash
  columns in one ``sigrid_hash_multi``, one hash per jagged column), producing TorchRec's jagged layout:
  ids, per-(table, row) offsets and per-id weights (1 / bag length for mean columns, else 1). It is plain
  torch, meant to be ``torch.compile``d on its own.
* ``TBELayer``: fbgemm's table-batched embedding (``IntNBitTableBatchedEmbeddingBagsCodegen``, FP32 rows,
  one kernel for all tables, SUM with those weights, i.e. mean where a column means).
* ``EBCLayer``: torchrec's unsharded ``EmbeddingBagCollection`` over a ``KeyedJaggedTensor``.
* ``DenseNet``: a ColumnModel's dense part over a precomputed embedding output.

Only ColumnModel / EmbeddingLayer from ``recforge.recom.family`` are converted. torch.bucketize puts NaN in
bucket K; the padded ``searchsorted`` puts it in the widest column's K: feed no NaN to the baselines.
"""
from __future__ import annotations

from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recforge_kernels  # noqa: F401
from recforge.recom.family.columns import (
    JAGGED_KINDS,
    BucketizedColumn,
    IntHashColumn,
    MultiHotColumn,
    RawIdColumn,
    SafeMultiHotColumn,
    StringHashColumn,
)
from recforge.recom.family.data import LENGTHS_SUFFIX
from recforge.recom.family.model import ColumnModel


def _columns(module: nn.Module) -> dict[str, nn.Module]:
    layer: Any = getattr(module, "embedding", module)  # a ColumnModel's EmbeddingLayer, or the layer itself
    return dict(layer.columns.items())


def _table(col: nn.Module) -> tuple[Tensor, str]:
    """(weight, combiner) of a family column."""
    if isinstance(col, BucketizedColumn):
        return col.bag.weight, col.bag.mode
    if isinstance(col, (IntHashColumn, StringHashColumn, RawIdColumn)):
        return col.embedding.weight, "sum"
    if isinstance(col, (MultiHotColumn, SafeMultiHotColumn)):
        return col.weight, col.combiner
    raise TypeError(f"{type(col).__name__} is not a recforge.recom.family column")


class GroupedPreprocess(nn.Module):
    """features -> (ids int64[nnz], offsets int64[T*B + 1], weights float32[nnz]), tables in column order."""

    # buffers, registered in __init__
    boundaries: Tensor
    mod_n: Tensor
    string_m: Tensor

    def __init__(self, module: nn.Module):
        super().__init__()
        cols = _columns(module)
        self.names = list(cols)
        self.kinds = [c.kind for c in cols.values()]
        for c in cols.values():
            if c.kind == "raw_id" and c.oov != "zero":
                raise ValueError("raw ids without a guard are not converted")
        bucket = [c for c in cols.values() if isinstance(c, BucketizedColumn)]
        kmax = max((c.boundaries.numel() for c in bucket), default=1)
        pad = torch.full((len(bucket), kmax), float("inf"))
        for i, c in enumerate(bucket):
            pad[i, : c.boundaries.numel()] = c.boundaries
        self.register_buffer("boundaries", pad)
        self.register_buffer("mod_n", torch.tensor([[c.num_rows] for c in cols.values() if c.kind == "int_hash"],
                                                   dtype=torch.int64).reshape(-1, 1))
        strings = [c for c in cols.values() if isinstance(c, StringHashColumn)]
        self.string_salts = sorted({c.salt for c in strings})
        self.register_buffer("string_m", torch.tensor([c.num_rows for c in strings], dtype=torch.int64))
        self.string_salt = [c.salt for c in strings]
        self.jagged = [(n, c.salt, c.num_rows, c.combiner) for n, c in cols.items()
                       if isinstance(c, (MultiHotColumn, SafeMultiHotColumn))]
        self.raw = [(n, c.num_rows) for n, c in cols.items() if isinstance(c, RawIdColumn)]
        self.groups = {k: [n for n, c in cols.items() if c.kind == k]
                       for k in ("bucketized", "int_hash", "string_hash")}

    def forward(self, features: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        batch = features[self.names[0] + LENGTHS_SUFFIX].shape[0] if self.kinds[0] in JAGGED_KINDS \
            else features[self.names[0]].shape[0]
        ids: dict[str, Tensor] = {}
        if self.groups["bucketized"]:
            x = torch.stack([features[n] for n in self.groups["bucketized"]])
            out = torch.searchsorted(self.boundaries, x.contiguous())
            ids.update(zip(self.groups["bucketized"], out.unbind(0), strict=True))
        if self.groups["int_hash"]:
            x = torch.stack([features[n] for n in self.groups["int_hash"]])
            ids.update(zip(self.groups["int_hash"], torch.remainder(x, self.mod_n).unbind(0), strict=True))
        if self.groups["string_hash"]:
            x = torch.stack([features[n] for n in self.groups["string_hash"]], dim=1)
            hashed = torch.empty_like(x)
            for salt in self.string_salts:  # one call per distinct salt (the family draws one per column)
                sel = [j for j, s in enumerate(self.string_salt) if s == salt]
                idx = torch.tensor(sel)
                hashed[:, idx] = torch.ops.recforge.sigrid_hash_multi(x[:, idx].contiguous(), salt, self.string_m[idx])
            ids.update(zip(self.groups["string_hash"], hashed.unbind(1), strict=True))
        for n, rows in self.raw:
            x = features[n]
            ids[n] = torch.where((x >= 0) & (x < rows), x, torch.zeros_like(x))
        lengths: dict[str, Tensor] = {}
        weights: dict[str, Tensor] = {}
        for n, salt, rows, combiner in self.jagged:
            ids[n] = torch.ops.recforge.sigrid_hash(features[n], salt, rows)
            lengths[n] = features[n + LENGTHS_SUFFIX]
            if combiner == "mean":
                per_row = 1.0 / lengths[n].clamp(min=1).to(torch.float32)
                weights[n] = torch.repeat_interleave(per_row, lengths[n], output_size=ids[n].shape[0])
        ones_b = torch.ones(batch, dtype=torch.int64)
        all_ids = torch.cat([ids[n] for n in self.names])
        all_lengths = torch.cat([lengths.get(n, ones_b) for n in self.names])
        offsets = torch.cat([all_lengths.new_zeros(1), torch.cumsum(all_lengths, 0)])
        w = torch.cat([weights[n] if n in weights else torch.ones(ids[n].shape[0]) for n in self.names])
        return all_ids, offsets, w


class TBELayer(nn.Module):
    """All tables in one fbgemm TBE (FP32, host), pooled with per-id weights: [B, sum of dims]."""

    def __init__(self, module: nn.Module):
        super().__init__()
        tables = [_table(c)[0] for c in _columns(module).values()]
        specs = [(f"t{i}", t.shape[0], t.shape[1], SparseType.FP32, EmbeddingLocation.HOST)
                 for i, t in enumerate(tables)]
        self.tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=specs, pooling_mode=PoolingMode.SUM, device="cpu", output_dtype=SparseType.FP32)
        self.tbe.fill_random_weights()
        for (dst, *_), src in zip(self.tbe.split_embedding_weights(), tables, strict=True):
            rows, width = dst.shape
            dst.copy_(torch.nn.functional.pad(src.detach().contiguous().view(torch.uint8).view(rows, -1),
                                              (0, width - src.shape[1] * 4)))

    def forward(self, ids: Tensor, offsets: Tensor, weights: Tensor) -> Tensor:
        return self.tbe(ids.to(torch.int32), offsets.to(torch.int32), per_sample_weights=weights)


class EBCLayer(nn.Module):
    """torchrec's unsharded EmbeddingBagCollection (one nn.EmbeddingBag per table) over a KJT."""

    def __init__(self, module: nn.Module):
        super().__init__()
        cols = _columns(module)
        configs = []
        for n, c in cols.items():
            w, combiner = _table(c)
            configs.append(EmbeddingBagConfig(name=f"t_{n}", embedding_dim=w.shape[1], num_embeddings=w.shape[0],
                                              feature_names=[n], pooling=PoolingType.MEAN if combiner == "mean"
                                              else PoolingType.SUM))
        self.keys = list(cols)
        self.ebc = EmbeddingBagCollection(tables=configs)
        with torch.no_grad():
            for n, c in cols.items():
                self.ebc.embedding_bags[f"t_{n}"].weight.copy_(_table(c)[0])

    def forward(self, ids: Tensor, offsets: Tensor, weights: Tensor) -> Tensor:
        kjt = KeyedJaggedTensor(keys=self.keys, values=ids, offsets=offsets)
        return self.ebc(kjt).values()


class DenseNet(nn.Module):
    """A ColumnModel's dense part: sigmoid(head(top([bottom(dense), embeddings]))) as float32[B]."""

    def __init__(self, model: ColumnModel):
        super().__init__()
        self.bottom, self.top, self.head = model.bottom, model.top, model.head

    def forward(self, dense: Tensor, embedded: Tensor) -> Tensor:
        x = torch.cat([self.bottom(dense), embedded], dim=1)
        return torch.sigmoid(self.head(self.top(x))).squeeze(-1)


class Pipeline(nn.Module):
    """preprocess -> lookup (-> dense net): the baseline as one callable over the model's inputs."""

    def __init__(self, preprocess: nn.Module, lookup: nn.Module, dense: nn.Module | None = None):
        super().__init__()
        self.preprocess, self.lookup, self.dense = preprocess, lookup, dense

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        out = self.lookup(*self.preprocess(features))
        return out if self.dense is None else self.dense(features["dense"], out)
