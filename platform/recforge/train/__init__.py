"""TorchRec training building blocks: the DLRM, its sharding, the step loop, metrics; checkpoints in recovery/."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {  # defining module -> its public names
    "recforge.train.spec": ("WorkerSpec",),
    "recforge.train.result": ("WorkerResult",),
    "recforge.train.model": ("EBC_PATH", "build_dlrm", "embedding_configs"),
    "recforge.train.placement": ("Placement",),
    "recforge.train.sharding": (
        "ShardedModel", "check_placements", "make_planner", "plan_summary", "shard_model", "sharding_constraints",
        "to_torchrec",
    ),
    "recforge.train.batches": ("Batch", "TaskBatches", "TaskClient", "empty", "prepare"),
    "recforge.train.loss": ("step_loss",),
    "recforge.train.loop": ("EpochStats", "Heartbeat", "LoopState", "train_epoch"),
    "recforge.train.accumulate": ("train_epoch_accumulated",),
    "recforge.train.window": ("GroupStop", "WindowHook"),
    "recforge.train.ledger": ("Ledger", "audit"),
    "recforge.train.metrics": ("auc", "evaluate", "logloss", "normalized_entropy"),
    "recforge.train.metrics_sink": ("AsyncMetricsSink",),
    "recforge.train.probe": ("probe_logits",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining module on first use: the package stays cheap to import (its modules load torchrec)."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
