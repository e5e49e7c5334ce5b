"""Inference over raw tensors: preprocessing + DLRM -> click probabilities.

Two forms of the same computation:

* ``InferenceModule``: the eager reference. Preprocess, build a KeyedJaggedTensor with one id per
  row per feature (lengths all 1), call the torchrec DLRM, sigmoid.
* ``GatherInferenceModule`` (``InferenceModule.lowered()``): RECom's "provably one-hot lookups become
  gathers" in its simplest form. Every pooled EmbeddingBag lookup is replaced by
  ``F.embedding(ids[:, j], table.weight)`` over the *same* weight tensors, stacked to [B, F, D], then
  the DLRM's own ``dense_arch`` / ``inter_arch`` / ``over_arch`` submodules run unchanged. No KJT, so
  the graph exports with a dynamic batch dimension. Lowering is refused unless the preprocessing plan
  proves exactly one id per row for every feature (see ``recforge.recom.columns.onehot``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.recom.columns.onehot import prove_one_hot
from recforge.recom.errors import NotOneHotError, UnsupportedModelError

_DLRM_PARTS = ("sparse_arch", "dense_arch", "inter_arch", "over_arch")


@dataclass(frozen=True)
class Column:
    """One embedding column: the feature, the column of ``ids`` it reads, and its table."""

    feature: str
    input_index: int
    table: str
    num_embeddings: int
    embedding_dim: int


def unwrap_dlrm(model: nn.Module) -> DLRM:
    """Return the DLRM inside ``model`` (itself, or ``DLRMTrain.model``); refuse anything else."""
    inner = getattr(model, "model", None)
    if (inner is not None and not all(hasattr(model, p) for p in _DLRM_PARTS)
            and all(hasattr(inner, p) for p in _DLRM_PARTS)):
        model = inner
    missing = [p for p in _DLRM_PARTS if not hasattr(model, p)]
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a torchrec DLRM: it lacks {missing} "
            "(expected torchrec.models.dlrm.DLRM, DLRM_DCN or DLRM_Projection)"
        )
    ebc = getattr(model.sparse_arch, "embedding_bag_collection", None)
    if not isinstance(ebc, EmbeddingBagCollection):
        raise UnsupportedModelError(
            f"sparse_arch.embedding_bag_collection is {type(ebc).__name__}, not an unsharded "
            "torchrec EmbeddingBagCollection; load the model unsharded first "
            "(recforge.train.recovery.checkpoint.load_unsharded)"
        )
    return model


def _plan_feature_names(preprocess: nn.Module) -> list[str] | None:
    plan = getattr(preprocess, "plan", None)
    if plan is None or not hasattr(plan, "tables"):
        return None
    return [name for name, _ in plan.tables()]


class InferenceModule(nn.Module):
    """forward(dense int64[B,Fd], dense_valid bool[B,Fd], sparse int64[B,Fs], sparse_valid bool[B,Fs]) -> float32[B].

    ``feature_names`` are the KJT keys, one per column of the preprocessed ``ids``; by default the
    sparse features of ``preprocess_module.plan`` (``plan.tables()`` order), else the DLRM's own
    sparse feature order.
    """

    def __init__(self, preprocess_module: nn.Module, dlrm: nn.Module, feature_names: Sequence[str] | None = None):
        super().__init__()
        self.preprocess = preprocess_module
        self.dlrm = unwrap_dlrm(dlrm)
        names = list(feature_names) if feature_names is not None else _plan_feature_names(preprocess_module)
        if names is None:
            names = list(self.dlrm.sparse_arch.sparse_feature_names)
        self.feature_names: list[str] = names
        self.columns: list[Column] = self._columns()

    def _columns(self) -> list[Column]:
        ebc: EmbeddingBagCollection = self.dlrm.sparse_arch.embedding_bag_collection
        index = {n: i for i, n in enumerate(self.feature_names)}
        if len(index) != len(self.feature_names):
            raise ValueError(f"feature_names has duplicates: {self.feature_names}")
        cols = []
        for cfg in ebc.embedding_bag_configs():
            for feat in cfg.feature_names:
                if feat not in index:
                    raise UnsupportedModelError(
                        f"the DLRM's table {cfg.name!r} reads feature {feat!r}, which the preprocessing does not "
                        f"produce (produced: {self.feature_names})"
                    )
                cols.append(Column(feat, index[feat], cfg.name, cfg.num_embeddings, cfg.embedding_dim))
        return cols

    @property
    def num_tables(self) -> int:
        return len({c.table for c in self.columns})

    def forward(self, dense: torch.Tensor, dense_valid: torch.Tensor, sparse: torch.Tensor,
                sparse_valid: torch.Tensor) -> torch.Tensor:
        dense_f, ids = self.preprocess(dense, dense_valid, sparse, sparse_valid)
        batch, num = ids.shape
        kjt = KeyedJaggedTensor(
            keys=self.feature_names,
            values=ids.t().reshape(-1),  # feature-major: all rows of feature 0, then feature 1, ...
            lengths=torch.ones(num * batch, dtype=torch.int32, device=ids.device),
        )
        logits = self.dlrm(dense_f, kjt)
        return torch.sigmoid(logits).squeeze(-1)

    def lowered(self) -> GatherInferenceModule:
        """The gather form over the same weights; raises NotOneHotError unless one-hot is proven."""
        return GatherInferenceModule(self)

    to_gather_form = lowered


class GatherInferenceModule(nn.Module):
    """The exportable gather form of an InferenceModule (shares its parameters, copies nothing)."""

    def __init__(self, source: InferenceModule):
        super().__init__()
        plan = getattr(source.preprocess, "plan", None)
        if plan is None:
            raise NotOneHotError(
                f"cannot prove one id per row: preprocessing module {type(source.preprocess).__name__} has no `plan`"
            )
        self.one_hot_proof = prove_one_hot(plan, [c.feature for c in source.columns],
                                           scalar_sources=getattr(source.preprocess, "scalar_sources", False))
        id_bound = dict(plan.tables()) if hasattr(plan, "tables") else {}
        for c in source.columns:  # ids lie in [0, N) by the plan: every gather stays inside its table
            if c.feature in id_bound and id_bound[c.feature] > c.num_embeddings:
                raise UnsupportedModelError(
                    f"feature {c.feature!r}: the plan makes ids in [0, {id_bound[c.feature]}) but table "
                    f"{c.table!r} has {c.num_embeddings} rows; build the model from plan.tables()"
                )
        ebc: EmbeddingBagCollection = source.dlrm.sparse_arch.embedding_bag_collection
        if ebc.is_weighted():
            raise UnsupportedModelError(
                "weighted EmbeddingBagCollection: per-sample weights scale the rows; not lowered"
            )
        for cfg in ebc.embedding_bag_configs():
            if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise UnsupportedModelError(f"table {cfg.name!r}: pooling {cfg.pooling} is not SUM or MEAN")
        self.preprocess = source.preprocess
        self.tables = ebc.embedding_bags  # the same nn.EmbeddingBag modules: same weight tensors
        self.dense_arch = source.dlrm.dense_arch
        self.inter_arch = source.dlrm.inter_arch
        self.over_arch = source.dlrm.over_arch
        self.columns: list[Column] = list(source.columns)
        self.feature_names = list(source.feature_names)
        self._lookups: list[tuple[str, int]] = [(c.table, c.input_index) for c in self.columns]

    @property
    def num_tables(self) -> int:
        return len({c.table for c in self.columns})

    def forward(self, dense: torch.Tensor, dense_valid: torch.Tensor, sparse: torch.Tensor,
                sparse_valid: torch.Tensor) -> torch.Tensor:
        dense_f, ids = self.preprocess(dense, dense_valid, sparse, sparse_valid)
        # One id per row: SUM or MEAN of a single row is that row, so a gather is exact.
        columns = ids.unbind(1)  # one op, F views (ids[:, j] per feature would be 2 ops each)
        rows = []
        for table, j in self._lookups:
            weight = self.tables[table].weight
            row = F.embedding(columns[j], weight)
            rows.append(row if weight.dtype == torch.float32 else row.float())
        embedded_sparse = torch.stack(rows, dim=1)  # [B, F, D], SparseArch's layout
        embedded_dense = self.dense_arch(dense_f)
        concatenated = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        return torch.sigmoid(self.over_arch(concatenated)).squeeze(-1)

