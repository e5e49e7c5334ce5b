"""DLRM / DLRM-DCN over one EmbeddingBagCollection table per sparse feature (torchrec)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.models.dlrm import DLRM, DLRM_DCN

from recforge.config import ModelConfig

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


def build_dlrm(
    model_cfg: ModelConfig,
    tables: Sequence[tuple[str, int]],
    num_dense: int,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    """forward(dense_features [B, num_dense] float, sparse_features KJT) -> logits [B, 1].

    Initialization draws from torch's global RNG: call under torch.manual_seed(seed) and two builds are
    identical (the distributed worker relies on this to start every rank from the same weights).
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
    if model_cfg.arch == "dlrm":
        return DLRM(**common)
    if model_cfg.arch == "dlrm_dcn":
        return DLRM_DCN(**common, dcn_num_layers=model_cfg.dcn_num_layers, dcn_low_rank_dim=model_cfg.dcn_low_rank_dim)
    raise ValueError(f"model.arch: unknown {model_cfg.arch!r}")
