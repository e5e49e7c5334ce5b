"""Writing a benchmark's JSON report: temp file + rename, so a crashed run never leaves half a report."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def write_report(path: Path, report: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(f.name, path)
    print(f"wrote {path}")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where there is none): every report records it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def time_forward_backward(calls: Iterable[Any], forward: Callable[[Any], Any],
                          backward: Callable[[Any, Any], None]) -> dict[str, float]:
    """Median seconds of forward(call) and backward(call, output) over `calls`, and of their sum per call."""
    fwd, bwd = [], []
    for call in calls:
        t0 = time.perf_counter()
        out = forward(call)
        t1 = time.perf_counter()
        backward(call, out)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return {"forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd),
            "total_s": statistics.median(a + b for a, b in zip(fwd, bwd, strict=True))}
