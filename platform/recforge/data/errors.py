"""Errors raised by the data stage."""
from __future__ import annotations


class DataError(ValueError):
    """Input data that cannot be ingested as a whole (empty, all bad, too many bad rows, corrupt shard)."""
