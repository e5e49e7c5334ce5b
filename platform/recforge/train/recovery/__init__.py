"""Checkpoints and restarts: step checkpoints on disk or in memory (flash), their layout, resuming a group."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {  # defining module -> its public names
    "recforge.train.recovery.spec": ("RecoverySpec",),
    "recforge.train.recovery.checkpoint": ("load_unsharded", "save_checkpoint"),
    "recforge.train.recovery.checkpointer": ("Checkpointer",),
    "recforge.train.recovery.flash": ("FlashSnapshotter", "agent_present"),
    "recforge.train.recovery.layout": ("Candidate", "candidates", "step_dirs"),
    "recforge.train.recovery.resume": ("Restored", "load_latest"),
    "recforge.train.recovery.restart": ("GroupStart", "resume_group"),
    "recforge.train.recovery.faults": ("InjectedFault", "maybe_inject"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining module on first use: the elastic master reads spec / layout without torch."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
