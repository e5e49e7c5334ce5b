"""Readers of raw day files: `read_source` dispatches by the dataset's format; this module is the Criteo path.

Criteo day files (tab-separated, no header, optionally gzip; any schema with `is_criteo_layout`).

Line layout: label (0/1), dense integers (may be negative), sparse 32-bit hex strings of 1-8 digits;
an empty field is a missing value. A line ends at "\\n"; one "\\r" right before it (CRLF) is part of
the line ending. Every row that does not fit is written to the quarantine with a reason naming the
column and is not returned; nothing is dropped silently or coerced.

Fast path, per block of whole lines (~8 MiB): pyarrow.csv splits the block into string columns,
skipping lines with the wrong field count and reporting their line numbers; a block holding
non-ASCII bytes, a "\\r" or an empty line first goes through a numpy scan of line bounds and tab
counts that sets such lines aside. Label and dense columns are validated and cast with pyarrow
compute, hex is parsed with a numpy lookup table over pairs of digits. Rows that fail any check
are re-checked by `parse_line_reference`, the slow and obvious per-row parser, which supplies the
reason (and which the tests compare the fast path with).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recforge.config import DatasetConfig
from recforge.data.blocks import finish_block, line_bounds
from recforge.data.encodings import INT64_MAX, INT64_MIN, vec_hex, vec_int
from recforge.data.quarantine import Quarantine
from recforge.data.rawinput import GZIP_MAGIC, RawInput, is_gzip, line_blocks, rebatch
from recforge.data.reader_parquet import read_parquet
from recforge.data.reader_text import read_text
from recforge.data.schema import arrow_schema, column_names, empty_batch

__all__ = ["BLOCK_BYTES", "GZIP_MAGIC", "is_gzip", "parse_line_reference", "read_criteo", "read_criteo_table",
           "read_source", "read_source_table"]

BLOCK_BYTES = 8 << 20
MAX_HEX_DIGITS = 8
_INT_RE = re.compile(r"-?[0-9]+", re.ASCII)
_HEX_RE = re.compile(r"[0-9a-fA-F]+", re.ASCII)


# ----------------------------------------------------------------------------------------------
# the slow, obvious reference


def parse_line_reference(raw: bytes, dataset: DatasetConfig) -> tuple[list[int | None] | None, str | None]:
    """Parse one raw line (without its "\\n"). Returns (values, None) or (None, reason)."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    names = column_names(dataset)
    fields = raw.split(b"\t")
    if len(fields) != len(names):
        return None, f"wrong field count: expected {len(names)}, got {len(fields)}"
    n_dense = len(dataset.dense)
    values: list[int | None] = []
    reasons: list[str] = []
    for i, (name, field) in enumerate(zip(names, fields, strict=True)):
        try:
            s = field.decode("utf-8")
        except UnicodeDecodeError:
            shown = field.decode("utf-8", errors="backslashreplace")
            reasons.append(f"{name}: undecodable bytes (not UTF-8): {shown!r}")
            continue
        if i == 0:
            if s not in ("0", "1"):
                reasons.append(f"{name}: not 0/1: {s!r}")
            else:
                values.append(int(s))
        elif s == "":
            values.append(None)
        elif i <= n_dense:
            if not _INT_RE.fullmatch(s):
                reasons.append(f"{name}: not an integer: {s!r}")
            elif not INT64_MIN <= int(s) <= INT64_MAX:
                reasons.append(f"{name}: integer out of int64 range: {s!r}")
            else:
                values.append(int(s))
        else:
            if not _HEX_RE.fullmatch(s):
                reasons.append(f"{name}: invalid hex: {s!r}")
            elif len(s) > MAX_HEX_DIGITS:
                reasons.append(f"{name}: hex longer than {MAX_HEX_DIGITS} digits: {s!r}")
            else:
                values.append(int(s, 16))
    if reasons:
        return None, "; ".join(reasons)
    return values, None


_parse_hex = vec_hex
_parse_dense = vec_int


# ----------------------------------------------------------------------------------------------
# block parser


class _BlockParser:
    def __init__(self, dataset: DatasetConfig):
        self.dataset = dataset
        self.names = column_names(dataset)
        self.schema = arrow_schema(dataset)
        self.n_fields = len(self.names)
        self.n_dense = len(dataset.dense)
        self._read_opts = pacsv.ReadOptions(column_names=self.names, use_threads=False, block_size=1 << 22)
        self._parse_opts = pacsv.ParseOptions(
            delimiter="\t", quote_char=False, escape_char=False, double_quote=False,
            ignore_empty_lines=False, newlines_in_values=False,
        )
        self._convert_opts = pacsv.ConvertOptions(
            column_types={n: pa.string() for n in self.names},
            strings_can_be_null=True, null_values=[""], quoted_strings_can_be_null=False, check_utf8=False,
        )

    def _read_csv(self, data: bytes, on_invalid=None) -> pa.Table:
        parse_opts = self._parse_opts
        if on_invalid is not None:
            parse_opts = pacsv.ParseOptions(
                delimiter="\t", quote_char=False, escape_char=False, double_quote=False,
                ignore_empty_lines=False, newlines_in_values=False, invalid_row_handler=on_invalid,
            )
        return pacsv.read_csv(
            pa.BufferReader(data), read_options=self._read_opts, parse_options=parse_opts,
            convert_options=self._convert_opts,
        )

    def _try_plain(self, block: bytes, buf: np.ndarray, n_lines: int) -> tuple[pa.Table, list[int]] | None:
        """Optimistic split of a block without non-ASCII bytes, "\r" or empty lines.

        Returns (table of the lines with the right field count, indices of the other lines), or None
        when the block needs the line-by-line scan.
        """
        if int(buf.max()) >= 128 or b"\r" in block or b"\n\n" in block or block.startswith(b"\n"):
            return None
        misshaped: list[int | None] = []

        def on_invalid(row):  # a line with the wrong number of fields; number is its 1-based line
            misshaped.append(row.number)
            return "skip"

        table = self._read_csv(block, on_invalid)
        if None in misshaped or table.num_rows + len(misshaped) != n_lines:
            return None
        return table, [k - 1 for k in misshaped if k is not None]

    def _scan(self, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Lines the csv split must not see: wrong tab count, non-ASCII bytes, a "\r" not ending the line."""
        has_cr = (ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13)
        content_ends = ends - has_cr
        tabs = np.flatnonzero(buf == 9)
        n_tabs = np.searchsorted(tabs, ends) - np.searchsorted(tabs, starts)
        suspicious = n_tabs != self.n_fields - 1
        high = np.flatnonzero(buf >= 128)
        if high.size:
            suspicious[np.searchsorted(ends, high)] = True
        cr = np.flatnonzero(buf == 13)
        if cr.size:
            line_of = np.searchsorted(ends, cr)
            suspicious[line_of[cr != content_ends[line_of]]] = True
        return suspicious

    def parse(self, block: bytes) -> tuple[pa.RecordBatch, list[tuple[int, bytes, str]]]:
        """Parse whole lines. Returns (good rows, [(line index in block, raw line, reason)])."""
        buf = np.frombuffer(block, dtype=np.uint8)
        n_lines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
        starts = ends = None
        plain = self._try_plain(block, buf, n_lines)
        if plain is not None:
            table, bad_lines = plain
            good_lines = np.arange(n_lines)
            if bad_lines:
                good_lines = np.delete(good_lines, bad_lines)
        else:
            table = None
            starts, ends = line_bounds(buf)
            suspicious = self._scan(buf, starts, ends)
            good_lines = np.flatnonzero(~suspicious)
            bad_lines = [int(i) for i in np.flatnonzero(suspicious)]
            if good_lines.size:
                if bad_lines:
                    line_len = np.minimum(ends + 1, buf.size) - starts
                    block_ok = buf[np.repeat(~suspicious, line_len)].tobytes()
                else:
                    block_ok = block
                table = self._read_csv(block_ok)
                if table.num_rows != good_lines.size:
                    raise RuntimeError(f"reader: csv split {table.num_rows} rows, expected {good_lines.size}")

        bounds = (starts, ends) if starts is not None and ends is not None else None
        return finish_block(block, buf, table, good_lines, bad_lines, bounds, self._convert,
                            empty_batch(self.dataset), lambda raw: parse_line_reference(raw, self.dataset))

    def _convert(self, table: pa.Table) -> tuple[pa.RecordBatch, np.ndarray]:
        n = table.num_rows
        row_bad = np.zeros(n, dtype=bool)
        cols = [c.combine_chunks() for c in table.columns]

        label = cols[0]
        is_label = pc.or_(pc.equal(label, "0"), pc.equal(label, "1"))
        label_ok = np.asarray(pc.fill_null(is_label, False).to_numpy(zero_copy_only=False), dtype=bool)
        row_bad |= ~label_ok
        is_one = pc.fill_null(pc.equal(label, "1"), False).to_numpy(zero_copy_only=False)
        label_vals = np.asarray(is_one, dtype=np.int8)
        arrays: list[pa.Array] = [pa.array(label_vals, type=pa.int8())]

        for col in cols[1 : 1 + self.n_dense]:
            values, bad = _parse_dense(col)
            row_bad |= bad
            arrays.append(values)
        for col in cols[1 + self.n_dense :]:
            values, null, bad = _parse_hex(col)
            row_bad |= bad
            arrays.append(pa.array(values, type=pa.int64(), mask=null | bad))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema), row_bad


# ----------------------------------------------------------------------------------------------
# public entry point


def read_criteo(
    path: str | Path,
    dataset: DatasetConfig,
    quarantine: Quarantine,
    batch_rows: int = 65536,
    *,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Yield RecordBatches (arrow_schema(dataset)) of the valid rows, `batch_rows` rows each
    (the last may be shorter); every invalid row goes to `quarantine` with its 1-based line number.

    `on_progress(bytes)` is called after each block with the bytes consumed of the file on disk.
    """
    if batch_rows < 1:
        raise ValueError(f"read_criteo: batch_rows must be >= 1, got {batch_rows}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"read_criteo: file not found: {path}")
    parser = _BlockParser(dataset)
    source = RawInput(path, dataset.compression)

    def parsed() -> Iterator[pa.RecordBatch]:
        lines_before = 0
        for block in line_blocks(source, BLOCK_BYTES):
            if block:
                batch, rejected = parser.parse(block)
                for i, raw, reason in rejected:
                    quarantine.add(path, lines_before + i + 1, reason, raw)
                lines_before += block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
                yield batch
            if on_progress is not None:
                on_progress(source.disk_pos())

    try:
        yield from rebatch(parsed(), batch_rows)
    finally:
        source.close()


def read_criteo_table(path: str | Path, dataset: DatasetConfig, quarantine: Quarantine) -> pa.Table:
    """All valid rows of one file as a Table (convenience for small files and tests)."""
    batches = list(read_criteo(path, dataset, quarantine))
    return pa.Table.from_batches(batches, schema=arrow_schema(dataset))


def read_source(
    path: str | Path,
    dataset: DatasetConfig,
    quarantine: Quarantine,
    batch_rows: int = 65536,
    *,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Valid rows of one day file of any schema (arrow_schema(dataset)), bad rows quarantined.

    Dispatch: the Criteo layout -> read_criteo (the fast path above); other tsv/csv -> reader_text.read_text;
    parquet -> reader_parquet.read_parquet. Schema-level problems (header, Parquet columns and types, corrupt
    files) raise DataError naming the file, row or row group and column.
    """
    if batch_rows < 1:
        raise ValueError(f"read_source: batch_rows must be >= 1, got {batch_rows}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"read_source: file not found: {path}")
    if dataset.format == "parquet":
        return read_parquet(path, dataset, quarantine, batch_rows, on_progress=on_progress)
    if dataset.is_criteo_layout:
        return read_criteo(path, dataset, quarantine, batch_rows, on_progress=on_progress)
    return read_text(path, dataset, quarantine, batch_rows, on_progress=on_progress)


def read_source_table(path: str | Path, dataset: DatasetConfig, quarantine: Quarantine) -> pa.Table:
    """All valid rows of one file of any schema as a Table (convenience for small files and tests)."""
    return pa.Table.from_batches(list(read_source(path, dataset, quarantine)), schema=arrow_schema(dataset))
