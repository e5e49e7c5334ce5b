"""What a simulation of a given size needs in memory, checked before it starts (issue 17: a configuration the
machine cannot hold says so first, naming the limit)."""
from __future__ import annotations

from pathlib import Path

# From bench/bench_simulate.py --scale (bench/results/simulate_scale.json): peak RSS 94 MiB at 1k jobs / 100 nodes and
# 128 MiB at 10k / 1,000 for static (~4 KiB per job); DLRover-RM and Optimus keep a model and samples per live job
# and DLRover-RM a history record per finished job, so the check budgets 48 KiB per job (not measured at 100k).
BASE_BYTES = 250 << 20
BYTES_PER_JOB = 48 << 10
BYTES_PER_NODE = 2 << 10


class SimulationTooLarge(ValueError):
    """The requested simulation would not fit in this machine's memory."""


def needed_bytes(n_jobs: int, nodes: int) -> int:
    return BASE_BYTES + n_jobs * BYTES_PER_JOB + nodes * BYTES_PER_NODE


def available_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """MemAvailable of this machine (None where /proc/meminfo is not readable)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_size(n_jobs: int, nodes: int, available: int | None = None) -> int:
    """The bytes the run needs; SimulationTooLarge, naming the need and the limit, when it exceeds what is free."""
    if n_jobs < 1 or nodes < 1:
        raise SimulationTooLarge(f"a simulation needs at least 1 job and 1 node, got {n_jobs} jobs on {nodes} nodes")
    need = needed_bytes(n_jobs, nodes)
    avail = available_bytes() if available is None else available
    if avail is not None and need > avail:
        raise SimulationTooLarge(
            f"{n_jobs:,} jobs on {nodes:,} nodes need ~{need / 2**30:.1f} GiB ({BYTES_PER_JOB >> 10} KiB per job, "
            f"{BYTES_PER_NODE >> 10} KiB per node, {BASE_BYTES >> 20} MiB base; measured), but only "
            f"{avail / 2**30:.1f} GiB is available (MemAvailable): use fewer jobs or a larger machine")
    return need
