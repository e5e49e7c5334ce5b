"""RAP's mapping on the training side: the sharded EBC takes ids already on their table's worker (no input all-to-all).

With RAP's mapping (docs/rap.md) rank r preprocesses the sparse features of the tables it holds (table_wise or
column_wise) over the GLOBAL batch (every rank's padded local batch, concatenated in rank order) and the features of
data_parallel tables over its LOCAL batch. That is exactly what torchrec's input distribution would have delivered to
r's lookups, so the KJT all-to-all is skipped: `MappedInput.install(dmp)` swaps the ShardedEmbeddingBagCollection's
forward (as torchrec's own train pipelines swap it for their pipelined forward) for one that, given
`MappedFeatures`, builds the per-sharding KJTList itself and calls `compute_and_output_dist`; only the pooled-embedding
output all-to-all remains. A plain KeyedJaggedTensor still goes through the original forward (input all-to-all), so
every rank must pass MappedFeatures in the same step, or none.

    mapped = MappedInput.install(sharded.model, rank, world_size)
    mapped.global_features / mapped.local_features       # what this rank must preprocess, over which rows
    logits = sharded.model(dense, MappedFeatures(local=kjt_local, global_=kjt_global))
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

GLOBAL_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value)
LOCAL_TYPES = (ShardingType.DATA_PARALLEL.value,)


class MappedInputError(ValueError):
    """The sharded model or the given features do not fit RAP's mapping; the message names what is wrong."""


@dataclass
class MappedFeatures:
    """One step's sparse input under the mapping: `global_` holds the features of the tables this rank holds
    over world*B rows (rank order), `local` the data_parallel tables' features over this rank's B rows."""

    local: KeyedJaggedTensor | None
    global_: KeyedJaggedTensor | None
    batch_size: int  # local B


@dataclass(frozen=True)
class _Sharding:
    kind: str
    keys: tuple[str, ...]  # the features this rank's lookup of this sharding takes, in its order
    inputs: int  # features of this sharding in the (pre all-to-all) input KJT


def _empty_kjt(stride: int, like: KeyedJaggedTensor | None) -> KeyedJaggedTensor:
    device = like.values().device if like is not None else torch.device("cpu")
    dtype = like.values().dtype if like is not None else torch.int64
    return KeyedJaggedTensor(keys=[], values=torch.empty(0, dtype=dtype, device=device),
                             lengths=torch.empty(0, dtype=torch.int32, device=device), stride=stride)


def _select(kjt: KeyedJaggedTensor | None, keys: Sequence[str], stride: int, what: str) -> KeyedJaggedTensor:
    if not keys:
        return _empty_kjt(stride, kjt)
    if kjt is None:
        raise MappedInputError(f"mapped input: {what} features {list(keys)} expected, none given")
    if kjt.stride() != stride:
        raise MappedInputError(f"mapped input: {what} features have {kjt.stride()} rows, expected {stride}")
    have = kjt.keys()
    missing = [k for k in keys if k not in have]
    if missing:
        raise MappedInputError(f"mapped input: {what} features {missing} missing (given: {have})")
    if list(keys) == list(have):
        return kjt
    return kjt.permute([have.index(k) for k in keys])


class MappedInput:
    """The mapped forward of one rank's ShardedEmbeddingBagCollection; `install` puts it in place."""

    def __init__(self, sebc: ShardedEmbeddingBagCollection, rank: int, world_size: int) -> None:
        self.sebc, self.rank, self.world_size = sebc, rank, world_size
        if getattr(sebc, "_has_mean_pooling_callback", False):
            raise MappedInputError("mapped input: mean-pooled tables need torchrec's input distribution (divisor); "
                                   "the mapping handles SUM pooling")
        shardings = []
        for kind, sharding in zip(sebc._sharding_types, sebc._embedding_shardings, strict=True):
            if kind in GLOBAL_TYPES:
                keys = sharding.feature_names_per_rank()[rank]
            elif kind in LOCAL_TYPES:
                keys = sharding.feature_names()
            else:
                raise MappedInputError(f"mapped input: sharding type {kind!r} needs an id redistribution step; "
                                       f"the mapping handles {list(GLOBAL_TYPES + LOCAL_TYPES)}")
            shardings.append(_Sharding(kind, tuple(keys), len(sharding.feature_names())))
        self.shardings = shardings
        self._original_forward = sebc.forward

    @classmethod
    def install(cls, model: torch.nn.Module, rank: int, world_size: int) -> MappedInput:
        """Find the sharded EBC in `model` (a DMP) and swap its forward for the mapped one; idempotent. The
        instance attribute shadows the class's forward, so module hooks still run around it."""
        sebc = _sharded_ebc(model)
        installed = getattr(sebc.__dict__.get("forward"), "__self__", None)
        if isinstance(installed, MappedInput):
            return installed
        mapped = cls(sebc, rank, world_size)
        sebc.forward = mapped.forward
        return mapped

    @property
    def global_features(self) -> list[str]:
        """Features this rank preprocesses over the global batch (tables it holds, in first-use order)."""
        return list(dict.fromkeys(k for s in self.shardings if s.kind in GLOBAL_TYPES for k in s.keys))

    @property
    def local_features(self) -> list[str]:
        """Sparse features this rank preprocesses over its local batch (data_parallel tables)."""
        return list(dict.fromkeys(k for s in self.shardings if s.kind in LOCAL_TYPES for k in s.keys))

    def forward(self, features):
        if isinstance(features, KeyedJaggedTensor):
            return self._original_forward(features)
        if not isinstance(features, MappedFeatures):
            raise MappedInputError(f"mapped input: expected MappedFeatures or a KeyedJaggedTensor, "
                                   f"got {type(features).__name__}")
        b = features.batch_size
        ctx = self.sebc.create_context()
        dist_input = []
        for s in self.shardings:
            if s.kind in GLOBAL_TYPES:
                dist_input.append(_select(features.global_, s.keys, b * self.world_size, "global"))
            else:
                dist_input.append(_select(features.local, s.keys, b, "local"))
            ctx.sharding_contexts.append(EmbeddingShardingContext(batch_size_per_feature_pre_a2a=[b] * s.inputs))
        return self.sebc.compute_and_output_dist(ctx, KJTList(dist_input))


def _sharded_ebc(model: torch.nn.Module) -> ShardedEmbeddingBagCollection:
    for mod in model.modules():
        if isinstance(mod, ShardedEmbeddingBagCollection):
            return mod
    raise MappedInputError(f"mapped input: {type(model).__name__} has no ShardedEmbeddingBagCollection "
                           "(shard the model with torchrec first)")
