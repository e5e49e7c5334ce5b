"""What the text readers share once a block of lines is split: line bounds, and turning the converted rows into
(valid rows, rejected lines with the reference parser's reason)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa

Reference = Callable[[bytes], tuple[object, str | None]]  # raw line -> (values, None) or (None, reason)
Rejected = list[tuple[int, bytes, str]]  # (line index in the block, raw line, reason)


def line_bounds(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of every line of a block (ends exclude the "\\n")."""
    nl = np.flatnonzero(buf == 10)
    ends = nl if (buf.size and buf[-1] == 10) else np.append(nl, buf.size)
    starts = np.concatenate(([0], nl + 1))[: ends.size]
    return starts, ends


def finish_block(block: bytes, buf: np.ndarray, table: pa.Table | None, good_lines: np.ndarray,
                 bad_lines: list[int], bounds: tuple[np.ndarray, np.ndarray] | None,
                 convert: Callable[[pa.Table], tuple[pa.RecordBatch, np.ndarray]], empty: pa.RecordBatch,
                 reference: Reference) -> tuple[pa.RecordBatch, Rejected]:
    """Convert the well-shaped lines (`table`, one row per `good_lines`), move rows that fail conversion to the
    bad lines, and give every bad line the reference parser's reason (which must reject it too)."""
    if table is not None and table.num_rows:
        batch, row_bad = convert(table)
        if row_bad.any():
            bad_lines.extend(int(i) for i in good_lines[row_bad])
            batch = batch.filter(pa.array(~row_bad))
    else:
        batch = empty
    rejected: Rejected = []
    if bad_lines:
        starts, ends = bounds if bounds is not None else line_bounds(buf)
        for i in sorted(bad_lines):
            raw = block[starts[i] : ends[i]]
            _, reason = reference(raw)
            if reason is None:
                raise RuntimeError(f"reader: fast path rejected a row the reference accepts: {raw!r}")
            rejected.append((i, raw, reason))
    return batch, rejected
