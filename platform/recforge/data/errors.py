"""Errors raised by the data stage: a data error is the data's fault, not the code's, and says where it is."""
from __future__ import annotations

from pathlib import Path


class DataError(ValueError):
    """Input data that cannot be ingested (a bad schema, empty or corrupt files, too many bad rows, a late file).

    The message is one line a data engineer can act on: the file, the row (or Parquet row group), the column and
    the reason. Structured fields are kept for callers that classify or display errors.
    """

    def __init__(self, message: str, *, path: str | Path | None = None, row: int | None = None,
                 row_group: int | None = None, column: str | None = None, reason: str | None = None):
        self.path = str(path) if path is not None else None
        self.row = row
        self.row_group = row_group
        self.column = column
        self.reason = reason or message
        where = []
        if self.path is not None and self.path not in message:
            where.append(self.path)
        if row is not None and f"row {row}" not in message and f"line {row}" not in message:
            where.append(f"row {row}")
        if row_group is not None and "row group" not in message:
            where.append(f"row group {row_group}")
        if column is not None and repr(column) not in message and f"column {column}" not in message:
            where.append(f"column {column!r}")
        text = " ".join(message.split())  # one line, whatever the parts held
        super().__init__(f"{', '.join(where)}: {text}" if where else text)

    def one_line(self) -> str:
        return str(self)
