"""Checkpoints and restarts: step checkpoints on disk or in memory (flash), their layout, resuming a group."""
from __future__ import annotations

from recforge.exports import lazy_exports

# Names resolve on first use: the elastic master reads spec / layout without torch.
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.train.recovery.spec": ("RecoverySpec",),
    "recforge.train.recovery.checkpoint": ("load_unsharded", "save_checkpoint"),
    "recforge.train.recovery.checkpointer": ("Checkpointer",),
    "recforge.train.recovery.flash": ("FlashSnapshotter", "agent_present"),
    "recforge.train.recovery.layout": ("Candidate", "candidates", "step_dirs"),
    "recforge.train.recovery.resume": ("Restored", "load_latest"),
    "recforge.train.recovery.restart": ("GroupStart", "resume_group"),
    "recforge.train.recovery.faults": ("InjectedFault", "maybe_inject"),
})
