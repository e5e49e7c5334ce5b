"""The workers' memory allocators, set to keep freed pages (environment variables for each launched rank).

A rank frees and allocates the same buffers every step (Arrow's decoded columns, the batch tensors, activations).
glibc returns freed memory above its trim threshold to the kernel and serves large blocks by mmap; Arrow's jemalloc
pool purges dirty pages after a second. Either way the next step faults fresh pages in: 1-13k minor faults per second
per rank measured in the bench's training job, where the reference loop (its batches built before its clock) had
~10/s. On this project's VMs a fault is expensive (free pages go back to the host). "kept" (the default) fixes
glibc's mmap threshold at 32 MiB, keeps up to 1 GiB freed at the heap's top, and puts Arrow on the system allocator,
so the pages stay with the process; "system" leaves every allocator as it is. Variables already set win.
Measured: docs/performance.md (tenth session).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

ALLOCATOR_ENV = "RECFORGE_ALLOCATOR"
ALLOCATORS: tuple[Literal["kept", "system"], ...] = ("kept", "system")
KEPT = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's largest; a fixed value also stops its dynamic raising
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(64 << 20),
    "ARROW_DEFAULT_MEMORY_POOL": "system",
}


def allocator_mode(environ: Mapping[str, str], default: str = ALLOCATORS[0]) -> Literal["kept", "system"]:
    """The mode env RECFORGE_ALLOCATOR names, else `default` (config resources.allocator; "kept"); ValueError naming
    the variable (or the config field) otherwise."""
    raw = environ.get(ALLOCATOR_ENV, "").strip()
    source = ALLOCATOR_ENV if raw else "resources.allocator"
    raw = raw or default
    for mode in ALLOCATORS:
        if raw == mode:
            return mode
    raise ValueError(f"{source}={raw!r}: expected one of {list(ALLOCATORS)}")


def allocator_env(environ: Mapping[str, str], default: str = ALLOCATORS[0]) -> dict[str, str]:
    """Variables to add to a rank's environment `environ`: the mode (env RECFORGE_ALLOCATOR where `environ` sets it,
    else `default`, the job's resources.allocator) under its variable, so the rank can record it, and, for "kept",
    each of KEPT that `environ` does not set already."""
    mode = allocator_mode(environ, default)
    extra: dict[str, str] = {ALLOCATOR_ENV: mode}
    if mode == "kept":
        extra.update({k: v for k, v in KEPT.items() if k not in environ})
    return extra
