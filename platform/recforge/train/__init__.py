"""TorchRec training building blocks: the DLRM, its sharding, the step loop, metrics; checkpoints in recovery/."""
from __future__ import annotations

from recforge.exports import lazy_exports

# Names resolve on first use: the package stays cheap to import (its modules load torchrec).
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.train.spec": ("WorkerSpec",),
    "recforge.train.result": ("WorkerResult",),
    "recforge.train.model": ("EBC_PATH", "build_dlrm", "embedding_configs"),
    "recforge.train.placement": ("Placement",),
    "recforge.train.sharding": (
        "ShardedModel", "check_placements", "make_planner", "plan_summary", "shard_model", "sharding_constraints",
        "to_torchrec",
    ),
    "recforge.train.loop.batches": ("Batch", "TaskBatches", "TaskClient", "empty", "prepare"),
    "recforge.train.loop.loss": ("step_loss",),
    "recforge.train.loop.step_loop": ("EpochStats", "Heartbeat", "LoopState", "train_epoch"),
    "recforge.train.loop.accumulate": ("train_epoch_accumulated",),
    "recforge.train.loop.window": ("GroupStop", "WindowHook"),
    "recforge.train.loop.ledger": ("Ledger", "audit"),
    "recforge.train.metrics": ("auc", "evaluate", "logloss", "normalized_entropy"),
    "recforge.train.metrics_sink": ("AsyncMetricsSink",),
    "recforge.train.probe": ("probe_logits",),
})
