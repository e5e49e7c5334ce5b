"""Which kernel applies the embedding optimizer in backward for TorchRec's fused tables: recforge's C++ row-wise
Adagrad (recforge_kernels.rowwise_adagrad, train.rowwise_adagrad_kernel) or FBGEMM's own."""
from __future__ import annotations

import logging
from typing import Literal

import torch
from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag

from recforge_kernels.rowwise_adagrad import INSTALLED, install, unsupported

log = logging.getLogger(__name__)

EmbeddingUpdate = Literal["cpp", "fbgemm", "mixed", "none"]


def fused_embedding_modules(model: torch.nn.Module) -> list:
    """The FBGEMM modules (SplitTableBatchedEmbeddingBagsCodegen) behind a sharded model's fused tables. A sharded
    embedding collection keeps its lookups in a plain list (`_lookups`), outside `modules()`, so they are walked too."""
    roots = [model]
    for m in model.modules():
        lookups = getattr(m, "_lookups", None)
        if isinstance(lookups, list):
            roots.extend(x for x in lookups if isinstance(x, torch.nn.Module))
    found: dict[int, object] = {}
    for root in roots:
        for m in root.modules():
            if isinstance(m, BatchedFusedEmbeddingBag):
                found.setdefault(id(m.emb_module), m.emb_module)
    return list(found.values())


def use_rowwise_adagrad_kernel(model: torch.nn.Module) -> EmbeddingUpdate:
    """Route every fused embedding module of a sharded `model` that the kernels support through them (each other
    one's reason logged); returns embedding_update_kind(model)."""
    for tbe in fused_embedding_modules(model):
        if not install(tbe):  # install checks unsupported(tbe) itself; asked again only to log the reason
            log.info("fused embedding tables %s keep FBGEMM's backward: %s", getattr(tbe, "table_names", "?"),
                     unsupported(tbe))
    return embedding_update_kind(model)


def embedding_update_kind(model: torch.nn.Module) -> EmbeddingUpdate:
    """Which kernel updates the fused tables: cpp (recforge's, every module), fbgemm (FBGEMM's, every module), mixed,
    or none (the model has no fused tables)."""
    modules = fused_embedding_modules(model)
    if not modules:
        return "none"
    done = sum(bool(getattr(t, INSTALLED, False)) for t in modules)
    return "cpp" if done == len(modules) else "fbgemm" if done == 0 else "mixed"
