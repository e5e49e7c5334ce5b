"""The training process of one rank (`python -m recforge.worker SPEC_JSON`): train + RAP co-run + elastic client."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {  # defining module -> its public names
    "recforge.worker.trainer": ("PROBE_FILE", "rank_step_rows", "run"),
    "recforge.train.result": ("RESULT_FILE",),  # rank 0's output_dir holds RESULT_FILE (WorkerResult) and PROBE_FILE
    "recforge.worker.corun": ("epoch_source", "start_session", "worker_mapping"),
    "recforge.worker.elastic_client": ("launch_generation",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import the defining module on first use: the trainer loads torchrec, after main() has set up logging."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
