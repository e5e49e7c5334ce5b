"""The job master's incremental persistence: a compacted JSON snapshot plus an append-only log of changes.

`<state_file>` is the snapshot (the shape `read_master_state` returns: version, queue, workers, last_lease,
pending_scale) plus `log_from`; `<state_file>.log.NNNNNN` are the log segments, one line per call: a JSON list
of its changes, [kind, value] each (kinds below). The master appends a call's line before it answers; a
compaction rotates to a new segment, writes the snapshot of everything before it (temp file + rename) and deletes
the older segments. Restoring reads the snapshot and replays the segments from `log_from` on; a torn last line (a
crash in the middle of a write: that call was never answered) is dropped and said in the log.
Design: docs/fault_tolerance.md#the-job-masters-control-plane.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recforge.elastic.master.tasks import TaskQueue

log = logging.getLogger(__name__)

MASTER_STATE_VERSION = 1
QUEUE_CHANGES = ("rec", "poison", "epoch", "gen")  # TaskQueue.drain_changes / apply_change
# master-level changes: queue (the whole queue replaced: a restore), worker [id, stats], lease [worker, request
# id, grant] (the last lease answer, for retried requests), lease_clear, scale (the pending scale request)


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


@dataclass
class Restored:
    """The master's state as saved: the queue, per-worker statistics (dicts), last lease answers, scale request."""

    queue: TaskQueue
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_lease: dict[str, list[Any]] = field(default_factory=dict)
    pending_scale: dict[str, Any] | None = None
    lines: int = 0  # log lines replayed
    torn: str | None = None  # what was dropped at the end of the log

    def to_dict(self) -> dict[str, Any]:
        return {"version": MASTER_STATE_VERSION, "queue": self.queue.to_dict(), "workers": self.workers,
                "last_lease": self.last_lease, "pending_scale": self.pending_scale}


class StateLog:
    """Snapshot + log segments of one master state file. Not thread-safe: the master calls it under its lock,
    except `write_snapshot` (one compactor at a time)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.segment: int | None = None  # the segment being appended to
        self._fd: int | None = None

    def segment_path(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.log.{n:06d}")

    def segments(self) -> list[tuple[int, Path]]:
        pat = re.compile(re.escape(self.path.name) + r"\.log\.(\d+)$")
        found = [(int(m.group(1)), p) for p in self.path.parent.glob(self.path.name + ".log.*")
                 if (m := pat.match(p.name))]
        return sorted(found)

    def exists(self) -> bool:
        return self.path.exists() or bool(self.segments())

    # ---- reading -------------------------------------------------------------------------
    def load(self) -> Restored:
        """Snapshot + replay of the log after it. FileNotFoundError when nothing was saved."""
        for _ in range(20):  # a running master may fold segments into a new snapshot while we read
            try:
                return self._load_once()
            except _Moved:
                continue
        raise TimeoutError(f"{self.path}: the log kept changing while it was read (20 tries)")

    def _load_once(self) -> Restored:
        if not self.path.exists():
            if self.segments():
                raise ValueError(f"{self.path}: log segments without a snapshot; the state is incomplete")
            raise FileNotFoundError(f"job master state not found: {self.path}")
        doc = json.loads(self.path.read_text())
        if doc.get("version") != MASTER_STATE_VERSION:
            raise ValueError(f"{self.path}: unsupported master state version {doc.get('version')!r}")
        out = Restored(queue=TaskQueue.from_dict(doc["queue"]), workers=dict(doc.get("workers", {})),
                       last_lease=dict(doc.get("last_lease", {})), pending_scale=doc.get("pending_scale"))
        start = int(doc.get("log_from", 0))
        segs = [(n, p) for n, p in self.segments() if n >= start]
        for i, (_, seg) in enumerate(segs):
            try:
                data = seg.read_bytes()
            except FileNotFoundError as e:
                raise _Moved() from e
            lines = data.split(b"\n")
            tail = lines.pop()  # b"" when the segment ends with a complete line
            last = i == len(segs) - 1
            for no, raw in enumerate(lines, 1):
                try:
                    change = json.loads(raw)
                except ValueError as e:
                    raise ValueError(f"{seg}:{no}: unreadable log line ({e}); the state is corrupt") from e
                if not isinstance(change, list):
                    raise ValueError(f"{seg}:{no}: a log line is a list of changes, got {str(change)[:120]}")
                for pair in change:
                    _apply(out, pair, f"{seg}:{no}")
                out.lines += 1
            if tail:
                if not last:
                    raise ValueError(f"{seg}: ends in an incomplete line but is not the last segment; corrupt")
                out.torn = f"{seg}: incomplete last line of {len(tail)} byte(s) dropped (a crash mid-write)"
        return out

    # ---- writing -------------------------------------------------------------------------
    def open(self, segment: int) -> None:
        self.close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.segment_path(segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.segment = segment

    def append(self, lines: list[str]) -> None:
        """Write `lines` (one write: the kernel has them before the call answers; no fsync)."""
        if self._fd is None or not lines:
            return
        data = ("\n".join(lines) + "\n").encode()
        while data:
            n = os.write(self._fd, data)
            data = data[n:]

    def rotate(self) -> int:
        """Start a new segment; returns its number (a snapshot taken now covers everything before it)."""
        assert self.segment is not None, "StateLog.rotate: not open"
        self.open(self.segment + 1)
        return self.segment

    def write_snapshot(self, text: str, log_from: int) -> None:
        """Replace the snapshot (temp file + rename), then delete the segments it covers (< `log_from`)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)
        for n, p in self.segments():
            if n < log_from:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Moved(Exception):
    """A segment was compacted away while it was read: read again."""


def _apply(out: Restored, change: list[Any], where: str) -> None:
    if not isinstance(change, list) or len(change) != 2:
        raise ValueError(f"{where}: a change is [kind, value], got {str(change)[:120]}")
    kind, value = change
    if kind in QUEUE_CHANGES:
        out.queue.apply_change(kind, value)
    elif kind == "queue":
        out.queue = TaskQueue.from_dict(value)
    elif kind == "worker":
        out.workers[value[0]] = value[1]
    elif kind == "lease":
        out.last_lease[value[0]] = [value[1], value[2]]
    elif kind == "lease_clear":
        out.last_lease.clear()
    elif kind == "scale":
        out.pending_scale = value
    else:
        raise ValueError(f"{where}: unknown change {kind!r}")


def read_master_state(path: str | Path) -> dict[str, Any]:
    """A job master's saved state (snapshot + log), as one dict: version, queue (TaskQueue.to_dict), workers,
    last_lease, pending_scale. Safe while the master runs (what it had written so far)."""
    return StateLog(path).load().to_dict()


def remove_master_state(path: str | Path) -> None:
    """Delete a master's saved state: the snapshot and its log segments (a job that starts over)."""
    sl = StateLog(path)
    for _, seg in sl.segments():
        seg.unlink(missing_ok=True)
    sl.path.unlink(missing_ok=True)
    sl.path.with_name(sl.path.name + ".tmp").unlink(missing_ok=True)
