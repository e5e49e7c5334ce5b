"""The `Backend` seam: launch, watch and stop a job's workers.

Implementations: `recforge.elastic.backends.local.LocalBackend` (torch.distributed.run on this machine);
a Kubernetes backend (worker pods created by the job master) plugs in here later.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from recforge.elastic.policy import ResourcePlan


class JobFailedError(RuntimeError):
    """The workers failed; the message carries the exit code, the log path and the log's tail."""

    def __init__(self, message: str, *, exit_code: int | None, log_path: Path | None = None,
                 log_tail: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.log_path = log_path
        self.log_tail = log_tail


@runtime_checkable
class Backend(Protocol):
    def launch(self, spec_path: Path, plan: ResourcePlan) -> Any:
        """Start `plan.workers` workers on the worker spec at `spec_path`; return a handle."""
        ...

    def wait(self, handle: Any, timeout: float | None = None, check: bool = True) -> int | None:
        """Wait for the workers to exit: their exit code, or None if still running after `timeout`
        seconds. With `check`, a non-zero exit raises JobFailedError (with the log's tail)."""
        ...

    def stop(self, handle: Any) -> None:
        """Stop every process of the job (idempotent)."""
        ...

    def log_tail(self, handle: Any) -> str:
        """The end of the job's log, for error messages."""
        ...
