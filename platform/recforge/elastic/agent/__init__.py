"""The worker side of elastic training: the job master's client and the flash-checkpoint persister."""
from __future__ import annotations

from typing import TYPE_CHECKING

from recforge.exports import lazy_exports

if TYPE_CHECKING:
    from recforge.elastic.agent.client import MasterClient as MasterClient
    from recforge.elastic.agent.client import MasterUnavailableError as MasterUnavailableError
    from recforge.elastic.agent.flash_checkpoint import FlashPersister as FlashPersister

# Names resolve on first use: the flash persister stays light to import (no httpx).
__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
    "recforge.elastic.agent.client": ("MasterClient", "MasterUnavailableError"),
    "recforge.elastic.agent.flash_checkpoint": ("FlashPersister",),
})
