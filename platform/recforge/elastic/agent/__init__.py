"""The worker side of elastic training: the job master's client and the flash-checkpoint persister."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recforge.elastic.agent.client import MasterClient, MasterUnavailableError
    from recforge.elastic.agent.flash_checkpoint import FlashPersister

# Names resolve on first use: the flash persister stays light to import (no httpx).
_EXPORTS = {
    "MasterClient": "recforge.elastic.agent.client",
    "MasterUnavailableError": "recforge.elastic.agent.client",
    "FlashPersister": "recforge.elastic.agent.flash_checkpoint",
}

__all__ = [
    "FlashPersister", "MasterClient", "MasterUnavailableError",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
