"""DLRM / DLRM-DCN over one EmbeddingBagCollection table per sparse feature (torchrec).

`build_dlrm(..., fused=True)` (what the trainer builds by default, train.fused_interaction) swaps two of torchrec's
parameter-free submodules for faster ones with the same math, names and state dict: `FusedInteractionArch` (DLRM's
dot interaction as one C++ kernel each way, recforge_kernels.interaction) and `KeyOrderSparseArch` (the pooled
embeddings as a view of the KeyedTensor when its keys are already in feature order, not 26 slices concatenated).
`fused=False` is torchrec's DLRM as it ships: what checkpoints load into (the registered, pickled model needs only
torch / torchrec) and the peer benchmark's reference trains. Design: docs/performance.md ("Twelfth session").
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.models.dlrm import DLRM, DLRM_DCN, InteractionArch, SparseArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import ModelConfig
from recforge_kernels.interaction import dot_interaction, extension

EBC_PATH = "sparse_arch.embedding_bag_collection"  # module path of the EBC inside DLRM


def embedding_configs(tables: Sequence[tuple[str, int]], embedding_dim: int) -> list[EmbeddingBagConfig]:
    """One table per sparse feature; table name == feature name (the KJT key)."""
    if not tables:
        raise ValueError("tables: at least one sparse feature is required")
    names = [name for name, _ in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"tables: feature names must be unique, got {names}")
    configs = []
    for name, rows in tables:
        if rows < 1:
            raise ValueError(f"tables: {name} has {rows} rows; need at least 1")
        configs.append(
            EmbeddingBagConfig(
                name=name, embedding_dim=embedding_dim, num_embeddings=int(rows),
                feature_names=[name], pooling=PoolingType.SUM,
            )
        )
    return configs


class FusedInteractionArch(InteractionArch):
    """torchrec's InteractionArch (same output, same pair order) computed by recforge_kernels.interaction."""

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        return dot_interaction(dense_features, sparse_features)


class KeyOrderSparseArch(SparseArch):
    """torchrec's SparseArch: [B, F, D] pooled embeddings in sparse_feature_names order. The EBC's KeyedTensor holds
    every key D wide: in that order its values are the answer as a view; in another order (a sharded EBC groups its
    keys by sharding type and rank) one index_select of whole keys reorders them. Otherwise, and under fx tracing,
    the pieces are concatenated as torchrec does."""

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__(embedding_bag_collection)
        self._orders: dict[tuple[str, ...], torch.Tensor | str | None] = {}

    def _order(self, keys: list[str], widths: list[int]) -> torch.Tensor | str | None:
        """Positions in `keys` of the features in order; "view" when that is every position in turn; None when the
        keys are not every feature once, D wide. Cached per key order."""
        key = tuple(keys)
        if key not in self._orders:
            where = {k: i for i, k in enumerate(keys)}
            ok = (len(keys) == self.F and set(where) == set(self.sparse_feature_names)
                  and all(w == self.D for w in widths))
            order = [where[n] for n in self.sparse_feature_names] if ok else None
            self._orders[key] = (None if order is None else "view" if order == list(range(self.F))
                                 else torch.tensor(order))
        return self._orders[key]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        kt = self.embedding_bag_collection(features)
        if not isinstance(kt, torch.fx.Proxy):
            order = self._order(kt.keys(), kt.length_per_key())
            if order is not None:
                values = kt.values().reshape(-1, self.F, self.D)
                return values if isinstance(order, str) else values.index_select(1, order.to(values.device))
        pieces = kt.to_dict()
        return torch.cat([pieces[name] for name in self.sparse_feature_names], dim=1).reshape(-1, self.F, self.D)


def interaction_kind(model: torch.nn.Module, device: torch.device | str = "cpu") -> str:
    """How `model`'s interaction runs on `device`: "cpp" (FusedInteractionArch over the C++ kernel), "torch" (its
    fallback: the kernel is unavailable, or not a CPU device) or "torchrec" (torchrec's own module)."""
    if not isinstance(getattr(model, "inter_arch", None), FusedInteractionArch):
        return "torchrec"
    return "cpp" if torch.device(device).type == "cpu" and extension() is not None else "torch"


def build_dlrm(
    model_cfg: ModelConfig,
    tables: Sequence[tuple[str, int]],
    num_dense: int,
    device: torch.device | str = "cpu",
    *,
    fused: bool = False,
) -> torch.nn.Module:
    """forward(dense_features [B, num_dense] float, sparse_features KJT) -> logits [B, 1].

    Initialization draws from torch's global RNG: call under torch.manual_seed(seed) and two builds are
    identical (the distributed worker relies on this to start every rank from the same weights), fused or not.
    `fused`: the faster interaction and sparse arch (module docstring; DLRM-DCN gets the sparse arch only).
    """
    if num_dense < 1:
        raise ValueError(f"num_dense: DLRM needs at least one dense feature, got {num_dense}")
    device = torch.device(device)
    ebc = EmbeddingBagCollection(tables=embedding_configs(tables, model_cfg.embedding_dim), device=device)
    common = dict(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=list(model_cfg.dense_arch),
        over_arch_layer_sizes=list(model_cfg.over_arch),
        dense_device=device,
    )
    model: DLRM
    if model_cfg.arch == "dlrm":
        model = DLRM(**common)
    elif model_cfg.arch == "dlrm_dcn":
        model = DLRM_DCN(**common, dcn_num_layers=model_cfg.dcn_num_layers,
                         dcn_low_rank_dim=model_cfg.dcn_low_rank_dim)
    else:
        raise ValueError(f"model.arch: unknown {model_cfg.arch!r}")
    if fused:  # parameter-free modules: no RNG drawn, the state dict unchanged
        model.sparse_arch = KeyOrderSparseArch(ebc)
        if model_cfg.arch == "dlrm":
            model.inter_arch = FusedInteractionArch(num_sparse_features=model.inter_arch.F)
    return model
