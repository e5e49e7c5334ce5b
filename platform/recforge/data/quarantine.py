"""Quarantine: one JSON line per rejected raw row, so bad input is never dropped silently.

Each record is {"file": str, "line": int (1-based), "reason": str, "raw": str}. Raw bytes that are
not UTF-8 are stored with errors="backslashreplace" so the record stays valid JSON and shows them.
The writer writes straight to `path`; ingest points it into its temporary output directory, which
is renamed into place only on success (so a failed run leaves no partial quarantine behind).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


class Quarantine:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO | None = open(self.path, "w", encoding="utf-8")
        self.count = 0
        self.last: dict | None = None  # the latest record, for error messages

    def add(self, file: str | Path, line: int, reason: str, raw: bytes | str) -> None:
        if self._fh is None:
            raise ValueError(f"quarantine {self.path} is closed")
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", errors="backslashreplace")
        rec = {"file": str(file), "line": int(line), "reason": reason, "raw": raw}
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        self.count += 1
        self.last = rec

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> Quarantine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def records(path: str | Path) -> Iterator[dict]:
        with open(path, encoding="utf-8") as fh:
            for text in fh:
                if text.strip():
                    yield json.loads(text)
