"""RAP's runtime in a worker: a schedule's kernels gated by the training stages, and the batches they feed."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {  # defining module -> its public names
    "recforge.rap.runtime.corun_runtime": ("CorunConfigError", "CorunJob", "CorunRuntime"),
    "recforge.rap.runtime.corun_batches": ("CorunBatch", "CorunTaskBatches"),
    "recforge.rap.runtime.session": ("CorunSession",),
    "recforge.rap.runtime.offline": ("OfflineError", "OfflineTaskBatches", "preprocess_manifest"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining module on first use: RAP's modules load torch, the package itself stays cheap."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
