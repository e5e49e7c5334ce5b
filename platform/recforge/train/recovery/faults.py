"""Fault injection for the failover tests: `RECFORGE_FAULTS` (JSON list) in a worker's environment.

Each fault: {"kind": "raise" | "oom" | "hang" | "exit" | "kill", "at_step": N, "rank": r (default any),
"generation": g (default any), "min_batch": b (oom only: fire only while the per-rank micro-batch
is larger than b), "message": "..."}. Checked at logging-window boundaries, so `at_step` fires at the
first boundary at or after N. Without the variable nothing happens (one dict lookup per window).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from typing import Any

log = logging.getLogger(__name__)

ENV = "RECFORGE_FAULTS"
KINDS = ("raise", "oom", "hang", "exit", "kill")


class InjectedFault(RuntimeError):
    """A deliberate failure (kind "raise")."""


def load(env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    raw = (env if env is not None else os.environ).get(ENV)
    if not raw:
        return []
    faults = json.loads(raw)
    if not isinstance(faults, list):
        raise ValueError(f"{ENV}: expected a JSON list of faults, got {type(faults).__name__}")
    for f in faults:
        if f.get("kind") not in KINDS:
            raise ValueError(f"{ENV}: fault kind must be one of {KINDS}, got {f.get('kind')!r}")
        if not isinstance(f.get("at_step"), int):
            raise ValueError(f"{ENV}: fault {f} needs an integer at_step")
    return faults


def maybe_inject(faults: list[dict[str, Any]], *, step: int, rank: int, generation: int, micro_batch: int) -> None:
    for f in faults:
        if step < f["at_step"] or f.get("_fired"):
            continue
        if f.get("rank") not in (None, rank) or f.get("generation") not in (None, generation):
            continue
        if f["kind"] == "oom" and micro_batch <= int(f.get("min_batch", 0)):
            continue
        f["_fired"] = True
        msg = f.get("message") or f"injected {f['kind']} at step {step} on rank {rank} (generation {generation})"
        log.warning("fault injection: %s", msg)
        if f["kind"] == "raise":
            raise InjectedFault(msg)
        if f["kind"] == "oom":
            raise MemoryError(msg)
        if f["kind"] == "exit":
            os._exit(int(f.get("code", 13)))
        if f["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang: no progress, no exit; the supervisor's hang detection must kill it
            time.sleep(3600)
