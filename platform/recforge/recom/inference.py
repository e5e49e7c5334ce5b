"""Inference over raw tensors: preprocessing + DLRM -> click probabilities.

Two forms of the same computation:

* ``InferenceModule``: the eager reference. Preprocess, build a KeyedJaggedTensor with one id per
  row per feature (lengths all 1), call the torchrec DLRM, sigmoid.
* ``GatherInferenceModule`` (``InferenceModule.lowered()``): RECom's "provably one-hot lookups become
  gathers" in its simplest form. Every pooled EmbeddingBag lookup is replaced by
  ``F.embedding(ids[:, j], table.weight)`` over the *same* weight tensors, stacked to [B, F, D], then
  the DLRM's own ``dense_arch`` / ``inter_arch`` / ``over_arch`` submodules run unchanged. No KJT, so
  the graph exports with a dynamic batch dimension. Lowering is refused unless the preprocessing plan
  proves exactly one id per row for every feature over a scalar column (see ``recforge.recom.columns.onehot``).
  A feature over a multi-hot (list) column is pooled with ``F.embedding_bag`` over its ids and offsets (firstx as
  per-sample weights 0 / 1), the table's pooling kept.

Inputs: ``(dense, dense_valid, sparse, sparse_valid)``, plus, when the plan reads multi-hot columns, a fifth
``jagged`` dict ``{"<column>": values int64[N], "<column>_lengths": lengths int64[B]}`` (docs/recom.md).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.preprocess.module import LENGTHS_SUFFIX, module_kjt
from recforge.recom.columns.onehot import prove_one_hot
from recforge.recom.errors import NotOneHotError, UnsupportedModelError
from recforge.recom.family.data import select_rows

_DLRM_PARTS = ("sparse_arch", "dense_arch", "inter_arch", "over_arch")


@dataclass(frozen=True)
class Column:
    """One embedding column: the feature, the column of ``ids`` it reads (for a multi-hot feature, ``jagged``:
    its index in the preprocessing's ``list_features``), and its table."""

    feature: str
    input_index: int
    table: str
    num_embeddings: int
    embedding_dim: int
    jagged: bool = False


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


def _list_features(preprocess: nn.Module) -> list[str]:
    return list(getattr(preprocess, "list_features", None) or [])


def _jagged_keys(preprocess: nn.Module) -> list[str]:
    names = getattr(preprocess, "jagged_input_names", None)
    return list(names()) if callable(names) else []


class _RawInputs:
    """What InferenceModule and its gather form share about their raw inputs."""

    preprocess: nn.Module

    def raw_input_names(self) -> list[str]:
        """Names of the flat inputs: dense, dense_valid, sparse, sparse_valid, then the jagged keys."""
        return ["dense", "dense_valid", "sparse", "sparse_valid", *_jagged_keys(self.preprocess)]

    def dynamic_shapes_for(self, inputs: Sequence[Any]) -> Any:
        """torch.export dynamic shapes for these inputs when they hold list columns (else None: the capture's
        own inference): one ``batch`` Dim for the four matrices and every lengths, one Dim per values tensor
        (so a values tensor whose size equals the batch is not taken for batch-major)."""
        keys = _jagged_keys(self.preprocess)
        if not keys or len(inputs) != 5 or not isinstance(inputs[4], dict):
            return None
        batch = torch.export.Dim("batch", min=1)
        lists = {k: {0: batch} if k.endswith(LENGTHS_SUFFIX) and k[:-len(LENGTHS_SUFFIX)] in inputs[4]
                 else {0: torch.export.Dim(f"n{i}_{re.sub(r'[^0-9A-Za-z_]', '_', k)}", min=0)}
                 for i, k in enumerate(inputs[4])}
        return ({0: batch}, {0: batch}, {0: batch}, {0: batch}, lists)

    def rows_of(self, inputs: Sequence[Any], rows: Sequence[int]) -> tuple:
        """The given rows of the raw inputs, list columns included (``select_raw_rows``)."""
        return select_raw_rows(inputs, rows)

    def export_example(self, inputs: Sequence[Any]) -> tuple:
        """``inputs`` made fit to trace with dynamic sizes (torch.export specializes sizes 0 and 1): at least two
        rows (repeated) and at least two values in each list column (zeros appended to the last row). Only the
        trace sees it; the compile is checked against eager on ``inputs`` as given."""
        inputs = tuple(inputs)
        if not _jagged_keys(self.preprocess) or len(inputs) != 5 or not isinstance(inputs[4], dict):
            return inputs
        short = [k for k, v in inputs[4].items() if k + LENGTHS_SUFFIX in inputs[4] and v.shape[0] < 2]
        if int(inputs[0].shape[0]) >= 2 and not short:
            return inputs
        if int(inputs[0].shape[0]) == 1:
            inputs = select_raw_rows(inputs, [0, 0])
        jagged = dict(inputs[4])
        for key, values in inputs[4].items():
            lengths = jagged.get(key + LENGTHS_SUFFIX)
            if lengths is None or values.shape[0] >= 2 or lengths.shape[0] == 0:
                continue
            pad = 2 - int(values.shape[0])
            jagged[key] = torch.cat([values, values.new_zeros(pad)])
            jagged[key + LENGTHS_SUFFIX] = torch.cat([lengths[:-1], lengths[-1:] + pad])
        return (*inputs[:4], jagged)


def select_raw_rows(inputs: Sequence[Any], rows: Sequence[int]) -> tuple:
    """The raw inputs (4 matrices [+ jagged dict]) of the given rows, in that order (rows may repeat)."""
    idx = torch.as_tensor(list(rows), dtype=torch.int64)
    out = [t.index_select(0, idx.to(t.device)) for t in inputs[:4]]
    if len(inputs) > 4:
        out.append(select_rows(dict(inputs[4]), idx))
    return tuple(out)


class InferenceModule(_RawInputs, nn.Module):
    """forward(dense int64[B,Fd], dense_valid bool[B,Fd], sparse int64[B,Fs], sparse_valid bool[B,Fs]
    [, jagged {"<column>": int64[N], "<column>_lengths": int64[B]}]) -> float32[B].

    ``feature_names`` are the KJT keys, one per sparse feature; by default the sparse features of
    ``preprocess_module.plan`` (``plan.tables()`` order), else the DLRM's own sparse feature order. The columns of
    the preprocessed ``ids`` are the names that are not list features (``preprocess.list_features``), in order.
    """

    def __init__(self, preprocess_module: nn.Module, dlrm: nn.Module, feature_names: Sequence[str] | None = None):
        super().__init__()
        self.preprocess = preprocess_module
        self.dlrm = unwrap_dlrm(dlrm)
        names = list(feature_names) if feature_names is not None else _plan_feature_names(preprocess_module)
        if names is None:
            names = list(self.dlrm.sparse_arch.sparse_feature_names)
        self.feature_names: list[str] = names
        self.list_features: list[str] = _list_features(preprocess_module)
        unknown = [n for n in self.list_features if n not in names]
        if unknown:
            raise ValueError(f"the preprocessing's list features {unknown} are not in feature_names {names}")
        self.columns: list[Column] = self._columns()

    def _columns(self) -> list[Column]:
        ebc: EmbeddingBagCollection = self.dlrm.sparse_arch.embedding_bag_collection
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"feature_names has duplicates: {self.feature_names}")
        lists = {n: k for k, n in enumerate(self.list_features)}
        index = {n: i for i, n in enumerate(n for n in self.feature_names if n not in lists)}
        cols = []
        for cfg in ebc.embedding_bag_configs():
            for feat in cfg.feature_names:
                if feat in lists:
                    cols.append(Column(feat, lists[feat], cfg.name, cfg.num_embeddings, cfg.embedding_dim, True))
                    continue
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
                sparse_valid: torch.Tensor, jagged: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        if not self.list_features:
            dense_f, ids = self.preprocess(dense, dense_valid, sparse, sparse_valid)
            batch, num = ids.shape
            kjt = KeyedJaggedTensor(
                keys=self.feature_names,
                values=ids.t().reshape(-1),  # feature-major: all rows of feature 0, then feature 1, ...
                lengths=torch.ones(num * batch, dtype=torch.int32, device=ids.device),
            )
        else:
            dense_f, ids, lists = self.preprocess(dense, dense_valid, sparse, sparse_valid, jagged)
            kjt = self._kjt(ids, lists)
        logits = self.dlrm(dense_f, kjt)
        return torch.sigmoid(logits).squeeze(-1)

    def _kjt(self, ids: torch.Tensor, lists: dict[str, tuple]) -> KeyedJaggedTensor:
        return module_kjt(self.feature_names, ids, lists)

    def lowered(self) -> GatherInferenceModule:
        """The gather form over the same weights; raises NotOneHotError unless one-hot is proven for every
        feature over a scalar column."""
        return GatherInferenceModule(self)

    to_gather_form = lowered


class GatherInferenceModule(_RawInputs, nn.Module):
    """The exportable gather form of an InferenceModule (shares its parameters, copies nothing)."""

    def __init__(self, source: InferenceModule):
        super().__init__()
        plan = getattr(source.preprocess, "plan", None)
        if plan is None:
            raise NotOneHotError(
                f"cannot prove one id per row: preprocessing module {type(source.preprocess).__name__} has no `plan`"
            )
        scalar = [c.feature for c in source.columns if not c.jagged]
        self.one_hot_proof = prove_one_hot(plan, scalar,
                                           scalar_sources=getattr(source.preprocess, "scalar_sources", False))
        for c in source.columns:
            if c.jagged:
                self.one_hot_proof[c.feature] = ("multi-hot column: pooled with F.embedding_bag over its ids and "
                                                 "offsets (not a one-id gather)")
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
        pooling = {}
        for cfg in ebc.embedding_bag_configs():
            if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                raise UnsupportedModelError(f"table {cfg.name!r}: pooling {cfg.pooling} is not SUM or MEAN")
            pooling[cfg.name] = "mean" if cfg.pooling == PoolingType.MEAN else "sum"
        self.preprocess = source.preprocess
        self.tables = ebc.embedding_bags  # the same nn.EmbeddingBag modules: same weight tensors
        self.dense_arch = source.dlrm.dense_arch
        self.inter_arch = source.dlrm.inter_arch
        self.over_arch = source.dlrm.over_arch
        self.columns: list[Column] = list(source.columns)
        self.feature_names = list(source.feature_names)
        self.list_features = list(source.list_features)
        # (table, ids column or list feature name, pooling of a list feature)
        self._lookups: list[tuple[str, int, str | None, str]] = [
            (c.table, c.input_index, self.list_features[c.input_index] if c.jagged else None, pooling[c.table])
            for c in self.columns]

    @property
    def num_tables(self) -> int:
        return len({c.table for c in self.columns})

    def forward(self, dense: torch.Tensor, dense_valid: torch.Tensor, sparse: torch.Tensor,
                sparse_valid: torch.Tensor, jagged: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        if self.list_features:
            dense_f, ids, lists = self.preprocess(dense, dense_valid, sparse, sparse_valid, jagged)
        else:
            dense_f, ids = self.preprocess(dense, dense_valid, sparse, sparse_valid)
            lists = {}
        # One id per row: SUM or MEAN of a single row is that row, so a gather is exact.
        columns = ids.unbind(1)  # one op, F views (ids[:, j] per feature would be 2 ops each)
        rows = []
        for table, j, name, mode in self._lookups:
            weight = self.tables[table].weight
            row = F.embedding(columns[j], weight) if name is None else _pool(lists[name], weight, mode)
            rows.append(row if weight.dtype == torch.float32 else row.float())
        embedded_sparse = torch.stack(rows, dim=1)  # [B, F, D], SparseArch's layout
        embedded_dense = self.dense_arch(dense_f)
        concatenated = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        return torch.sigmoid(self.over_arch(concatenated)).squeeze(-1)


def _pool(column: tuple, weight: torch.Tensor, mode: str) -> torch.Tensor:
    """A multi-hot feature's bag per row (EmbeddingBag semantics: an empty row pools to zeros). firstx's keep
    mask becomes per-sample weights 0 / 1 (sum mode only), MEAN then divides by the kept count."""
    values, lengths, keep, kept = column
    offsets = torch.cumsum(lengths, 0) - lengths
    if keep is None:
        return F.embedding_bag(values, weight, offsets, mode=mode)
    pooled = F.embedding_bag(values, weight, offsets, mode="sum", per_sample_weights=keep.to(weight.dtype))
    if mode == "mean":
        pooled = pooled / kept.clamp(min=1).unsqueeze(1).to(pooled.dtype)
    return pooled
