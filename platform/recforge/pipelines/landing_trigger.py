"""Waiting for a run's landing files: one look at the landing zone (`look`) and the deferrable trigger that repeats it
(`LandingTrigger`, run by `airflow triggerer`).

Imported by the triggerer: only light modules here (fsspec, Airflow's trigger base), no recforge config or data.
A day has landed when its files exist, are not empty and have stopped changing: either the day's `ready_marker`
exists, or its files' names and sizes are the same at two looks `settle_s` apart, or none of them was modified in
the last `settle_s` (the file system's modification time). Design: docs/data.md#landing-zone-sensor-and-backfill.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import fsspec
from airflow.triggers.base import BaseTrigger, TriggerEvent
from fsspec.implementations.local import LocalFileSystem

GLOB_CHARS = "*?["


def is_glob(path: str) -> bool:
    return any(c in path for c in GLOB_CHARS)


def hidden(name: str) -> bool:
    """A file a glob skips: `_SUCCESS`, `_temporary`, `.part` files (the Hive / Spark convention)."""
    base = name.rstrip("/").rsplit("/", 1)[-1]
    return base.startswith(("_", "."))


def url_of(fs: Any, path: str) -> str:
    """A listed path back as the caller would write it: local paths stay paths, others get their protocol."""
    return path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)


def _mtime(info: dict[str, Any]) -> float | None:
    """Seconds since the epoch a file was last written, where its file system says (local, S3, GCS, memory)."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
    return None


def list_day(pattern: str) -> dict[str, dict[str, Any]]:
    """url -> fsspec info of the files a day's pattern names (a glob: its matches, hidden files left out)."""
    fs, path = fsspec.core.url_to_fs(pattern)
    if is_glob(path):
        found = fs.glob(path, detail=True)
        return {url_of(fs, p): info for p, info in sorted(found.items())
                if info.get("type", "file") == "file" and not hidden(p)}
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return {}
    return {pattern: info} if info.get("type", "file") == "file" else {}


def exists(url: str) -> bool:
    fs, path = fsspec.core.url_to_fs(url)
    return bool(fs.exists(path))


@dataclass
class DayLook:
    """What one look found of one day."""

    day: str
    role: str
    pattern: str
    sizes: dict[str, int] = field(default_factory=dict)
    ready: bool = False
    why: str = ""  # why not ready

    def describe(self) -> str:
        return f"{self.day} ({self.role} day): {self.why}"


def look(expected: list[dict[str, Any]], previous: dict[str, dict[str, int]], settle_s: float,
         now: float | None = None) -> list[DayLook]:
    """One look at every day in `expected` ({"day", "role", "pattern", "marker"}); `previous`: each day's sizes at an
    earlier look at least `settle_s` ago ({} for none). Blocking (fsspec): the trigger runs it in a thread."""
    now = time.time() if now is None else now
    looks = []
    for want in expected:
        day = DayLook(day=want["day"], role=want["role"], pattern=want["pattern"])
        files = list_day(want["pattern"])
        day.sizes = {url: int(info.get("size") or 0) for url, info in files.items()}
        marker = want.get("marker")
        if not files:
            day.why = f"no file matches {want['pattern']}"
        elif empty := [u for u, n in day.sizes.items() if n == 0]:
            day.why = f"{', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty (still being written?)"
        elif marker:
            day.ready = exists(marker)
            day.why = "" if day.ready else f"its files are there but not the ready marker {marker}"
        else:
            stamps = [_mtime(info) for info in files.values()]
            quiet = all(s is not None for s in stamps) and now - max(s for s in stamps if s is not None) >= settle_s
            day.ready = quiet or previous.get(day.day) == day.sizes
            day.why = "" if day.ready else (f"{', '.join(day.sizes)} changed within the last {settle_s:g} s "
                                            "(still being written?)")
        looks.append(day)
    return looks


def not_ready_message(run_day: str, looks: list[DayLook], waited_s: float) -> str:
    """The sensor's timeout: one line naming the run's day and each missing or unfinished path."""
    missing = [d.describe() for d in looks if not d.ready]
    return (f"wait_for_data: the landing data of run day {run_day} did not arrive within {waited_s:g} s "
            f"(sensor_timeout_s): {'; '.join(missing)}")


class LandingTrigger(BaseTrigger):
    """Fires once every expected day has landed (event status "ready", with the files), or at `deadline` (epoch
    seconds; a triggerer restart keeps it) with status "timeout" naming what is missing, or "error" when the landing
    zone cannot be read at all (no fsspec implementation for the URL, permission denied). `previous`: the sizes the
    sensor saw just before deferring (the first look here waits `poke_s` to compare with them)."""

    def __init__(self, *, run_day: str, expected: list[dict[str, Any]], poke_s: float, deadline: float,
                 timeout_s: float, previous: dict[str, dict[str, int]] | None = None):
        super().__init__()
        self.run_day, self.expected, self.poke_s = run_day, expected, poke_s
        self.deadline, self.timeout_s, self.previous = deadline, timeout_s, previous or {}

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"run_day": self.run_day, "expected": self.expected, "poke_s": self.poke_s,
                 "deadline": self.deadline, "timeout_s": self.timeout_s, "previous": self.previous})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        previous = dict(self.previous)
        if previous:
            await asyncio.sleep(min(self.poke_s, max(0.0, self.deadline - time.time())))
        while True:
            try:
                looks = await asyncio.to_thread(look, self.expected, previous, self.poke_s)
            except (ImportError, ValueError, PermissionError) as e:  # no retry can fix these
                yield TriggerEvent({"status": "error", "run_day": self.run_day,
                                    "message": f"wait_for_data: cannot read the landing zone of run day "
                                               f"{self.run_day}: {type(e).__name__}: {e}"})
                return
            except OSError as e:  # a transient listing failure (network, NFS): looked at again next time
                self.log.warning("wait_for_data: looking at the landing zone failed, trying again in %g s: %s",
                                 self.poke_s, e)
                looks = None
            if looks is not None and all(d.ready for d in looks):
                yield TriggerEvent({"status": "ready", "run_day": self.run_day,
                                    "files": {d.day: sorted(d.sizes) for d in looks}})
                return
            if looks is not None:
                for d in looks:
                    if not d.ready:
                        self.log.info("wait_for_data: waiting for %s", d.describe())
                previous = {d.day: d.sizes for d in looks}
            left = self.deadline - time.time()
            if left <= 0:
                message = (not_ready_message(self.run_day, looks, self.timeout_s) if looks is not None else
                           f"wait_for_data: the landing zone of run day {self.run_day} could not be read "
                           f"within {self.timeout_s:g} s (sensor_timeout_s)")
                yield TriggerEvent({"status": "timeout", "run_day": self.run_day, "message": message,
                                    "missing": [d.describe() for d in looks or [] if not d.ready]})
                return
            await asyncio.sleep(min(self.poke_s, left))
