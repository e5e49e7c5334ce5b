"""What the preprocessing executors executed, counted per batch as it ran (not decided at construction).

Every executor counts each batch it preprocesses under the path that ran it: `cpp_single_pass` (the fused
executor's one `recforge::fused_chain` call, CPU), `cpp_per_group` (one C++ `recforge::fused_*` call per fused
group), `triton_per_group` (CUDA, Triton kernels where one exists), `torch_fallback` (the fused ops' torch
implementations: the C++ kernels did not load, or were switched off; the reason is kept), `eager`, `dali` (with
the ops DALI could not express and the path that ran them) and `module`. Group calls made from outside a batch
(RAP's co-run runs a batch's groups inside the training stages) are counted apart. Counts go to the executor's own
`ExecutionLog` and to one per process (`process_log()`), which the worker reads around its training loop
(`mark()` / `since()`) to record the path in its result (recforge.train.result.ExecutedPreprocessing).
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any

CPP_SINGLE_PASS = "cpp_single_pass"
CPP_PER_GROUP = "cpp_per_group"
TRITON_PER_GROUP = "triton_per_group"
TORCH_FALLBACK = "torch_fallback"
EAGER = "eager"
DALI = "dali"
MODULE = "module"
PATHS = (CPP_SINGLE_PASS, CPP_PER_GROUP, TRITON_PER_GROUP, TORCH_FALLBACK, EAGER, DALI, MODULE)
NATIVE = frozenset({CPP_SINGLE_PASS, CPP_PER_GROUP, TRITON_PER_GROUP})  # recforge_kernels' compiled kernels


class ExecutionLog:
    """Batches (and outside group calls) per path, how many of them ran on recforge_kernels' compiled kernels,
    and how often each reason was given per path (why a fallback, why not a single pass, DALI's fallback ops)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batches: Counter[str] = Counter()
        self.group_calls: Counter[str] = Counter()
        self.native = 0  # batches + group calls that ran on the C++ / Triton kernels throughout
        self.reasons: Counter[str] = Counter()  # "path\treason" -> count

    def add(self, path: str, *, native: bool, reason: str | None = None, group: bool = False) -> None:
        if path not in PATHS:
            raise ValueError(f"ExecutionLog: unknown path {path!r}; one of {list(PATHS)}")
        with self._lock:
            (self.group_calls if group else self.batches)[path] += 1
            self.native += int(native)
            if reason:
                self.reasons[f"{path}\t{reason}"] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"batches": dict(self.batches), "group_calls": dict(self.group_calls), "native": self.native,
                    "reasons": dict(self.reasons)}


_PROCESS = ExecutionLog()


def process_log() -> ExecutionLog:
    """Every top-level executor of this process counts here too."""
    return _PROCESS


def mark() -> dict[str, Any]:
    """The process log now; `since(mark)` gives what ran after it."""
    return _PROCESS.snapshot()


def since(before: dict[str, Any]) -> dict[str, Any]:
    """What the process's executors ran after `before` (a `mark()`), in `snapshot()` form."""
    now = _PROCESS.snapshot()

    def diff(key: str) -> dict[str, int]:
        d = Counter(now[key])
        d.subtract(before[key])
        return {k: v for k, v in d.items() if v > 0}

    return {"batches": diff("batches"), "group_calls": diff("group_calls"),
            "native": now["native"] - before["native"], "reasons": diff("reasons")}


def _joined(counts: dict[str, int]) -> str:
    return "+".join(p for p, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def summarize(requested: str, counts: dict[str, Any], **detail: Any) -> dict[str, Any]:
    """{requested, path, native_kernels, detail} (the fields of pipelines.outputs.ExecutorRecord) from a
    `snapshot()` / `since()`. `path` names what ran, most batches first ('+' between paths when several did;
    co-run group calls when no whole batch ran; 'none' when nothing ran); `native_kernels` is True only when
    something ran and all of it on recforge_kernels' compiled (C++ / Triton) kernels."""
    batches, groups = counts["batches"], counts["group_calls"]
    total = sum(batches.values()) + sum(groups.values())
    path = _joined(batches) or _joined(groups) or "none"
    reasons: dict[str, list[str]] = {}
    for key, n in sorted(counts["reasons"].items(), key=lambda kv: -kv[1]):
        p, why = key.split("\t", 1)
        reasons.setdefault(p, []).append(f"{why} (x{n})")
    return {
        "requested": requested,
        "path": path,
        "native_kernels": total > 0 and counts["native"] == total,
        "detail": {"batches": batches, "group_calls": groups,
                   "reasons": {p: " | ".join(r) for p, r in reasons.items()}, **detail},
    }
