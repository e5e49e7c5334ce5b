"""Reader for text day files of any schema (tsv/csv, header or not, quoting, gzip, CRLF).

A row is one physical line ("\\n"; a "\\r" right before it is part of the line ending); the line number in the
quarantine is the physical line, the header being line 1 when there is one. A UTF-8 BOM at the start of the file
is dropped. The header's names must be the schema's columns in file order (else a DataError naming the missing,
extra or misplaced columns, before any row is read).

Fast path per block of whole lines: pyarrow.csv splits the block into string columns (quotes per the schema,
wrong field counts reported by its handler), data.encodings converts each column vectorized. Lines pyarrow must
not see (empty lines, a lone "\\r", bytes that are not UTF-8, an unterminated quote) are set aside first: a cheap
check decides whether a block needs that line scan. Every rejected line is re-parsed by `parse_row_reference`,
the slow and obvious per-line parser (Python's csv module + data.encodings' per-value parsers), which gives the
reason naming the column; the tests check that both agree on every row.
"""
from __future__ import annotations

import csv
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recforge.config import DatasetConfig
from recforge.config.datasets import DenseFeature, LabelColumn, MultiHotFeature, SparseFeature, TimestampColumn
from recforge.data import encodings as enc
from recforge.data.blocks import finish_block, line_bounds
from recforge.data.errors import DataError
from recforge.data.quarantine import Quarantine
from recforge.data.rawinput import RawInput, line_blocks, rebatch
from recforge.data.schema import arrow_schema, empty_batch, stored_columns

BLOCK_BYTES = 8 << 20


# ---------------------------------------------------------------------------------------------- the reference


def split_reference(line: str, dataset: DatasetConfig) -> list[str] | None:
    """Fields of one line (without its line ending); None for an unterminated quote."""
    if line == "":
        return [""]
    quote = dataset.quote_char
    if quote is None:
        return line.split(dataset.field_delimiter)
    rows = list(csv.reader([line + "\n"], delimiter=dataset.field_delimiter, quotechar=quote, doublequote=True,
                           strict=False))
    fields = rows[0] if rows else [""]
    if any("\n" in f for f in fields):  # the line ended inside a quoted field
        return None
    return fields


def _column_value(spec: Any, s: str) -> tuple[Any, str | None]:
    """One field's value by role; reason without the column name."""
    if isinstance(spec, LabelColumn):
        if s in spec.positive:
            return 1, None
        if s in spec.negative:
            return 0, None
        return None, f"label value {s!r} is neither positive {spec.positive} nor negative {spec.negative}"
    if isinstance(spec, TimestampColumn):
        if s == "":
            return None, "missing timestamp"
        secs, why = enc.ref_timestamp(s, spec.format)
        return (None, why) if secs is None else (datetime.fromtimestamp(secs, UTC), None)
    if isinstance(spec, MultiHotFeature):
        return enc.ref_multi_hot(s, spec.encoding, spec.delimiter)
    if s == "":
        return None, None
    if isinstance(spec, DenseFeature):
        return enc.ref_float(s) if spec.dtype == "float" else enc.ref_int(s)
    if isinstance(spec, SparseFeature):
        return enc.ref_id(s, spec.encoding)
    raise TypeError(f"no value for column role {spec.role!r}")


def parse_row_reference(raw: bytes, dataset: DatasetConfig) -> tuple[dict[str, Any] | None, str | None]:
    """Parse one raw line (without its "\\n"): ({stored column: value}, None) or (None, reason)."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    text = raw.decode("utf-8", errors="surrogateescape")
    if "\r" in text:
        return None, "carriage return inside the line"
    fields = split_reference(text, dataset)
    if fields is None:
        return None, f"unterminated quote {dataset.quote_char!r}"
    if len(fields) != dataset.num_fields:
        return None, f"wrong field count: expected {dataset.num_fields}, got {len(fields)}"
    values: dict[str, Any] = {}
    reasons: list[str] = []
    for spec, field in zip(dataset.columns, fields, strict=True):
        try:
            field.encode("utf-8")
        except UnicodeEncodeError:
            shown = field.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="backslashreplace")
            reasons.append(f"column {spec.name!r}: undecodable bytes (not UTF-8): {shown!r}")
            continue
        if spec.role == "ignore":
            continue
        value, why = _column_value(spec, field)
        if why is not None:
            reasons.append(f"column {spec.name!r}: {why}")
        else:
            values[spec.name] = value
    if reasons:
        return None, "; ".join(reasons)
    return {c.name: values[c.name] for c in stored_columns(dataset)}, None


def check_header(line: bytes, dataset: DatasetConfig, path: Path) -> None:
    """The header line's names against the schema's columns (file order); DataError naming the difference."""
    if line.endswith(b"\r"):
        line = line[:-1]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: header line is not UTF-8 text: {e}", path=path, row=1) from None
    got = split_reference(text, dataset)
    if got is None:
        raise DataError(f"{path}: header line has an unterminated quote", path=path, row=1)
    want = dataset.field_names
    if got == want:
        return
    missing = [n for n in want if n not in got]
    extra = [n for n in got if n not in want]
    if missing or extra:
        parts = ([f"missing columns {missing}"] if missing else []) + ([f"extra columns {extra}"] if extra else [])
        reason = "header does not match the schema: " + ", ".join(parts)
    else:
        reason = f"header names the schema's columns in another order: {got}, schema: {want}"
    raise DataError(f"{path}: line 1: {reason}", path=path, row=1, reason=reason)


# ---------------------------------------------------------------------------------------------- the fast path


class TextBlockParser:
    """Parses blocks of whole lines of one dataset's text format."""

    def __init__(self, dataset: DatasetConfig):
        self.dataset = dataset
        self.schema = arrow_schema(dataset)
        self.specs = stored_columns(dataset)
        self.quote = dataset.quote_char
        names = dataset.field_names
        self._read_opts = pacsv.ReadOptions(column_names=names, use_threads=False, block_size=1 << 22)
        self._parse_kw = dict(delimiter=dataset.field_delimiter, quote_char=self.quote or False,
                              double_quote=self.quote is not None, escape_char=False, ignore_empty_lines=False,
                              newlines_in_values=False)
        self._convert_opts = pacsv.ConvertOptions(
            column_types={n: pa.string() for n in names}, include_columns=[c.name for c in self.specs],
            strings_can_be_null=True, null_values=[""], quoted_strings_can_be_null=True, check_utf8=False,
        )
        self._ts_cache: dict[str, int | None] = {}

    def _split(self, data: bytes) -> tuple[pa.Table, list[int | None]]:
        """(rows with the right field count, 1-based numbers of the other rows)."""
        misshaped: list[int | None] = []

        def on_invalid(row: Any) -> str:
            misshaped.append(row.number)
            return "skip"

        table = pacsv.read_csv(pa.BufferReader(data), read_options=self._read_opts,
                               parse_options=pacsv.ParseOptions(**self._parse_kw, invalid_row_handler=on_invalid),
                               convert_options=self._convert_opts)
        return table, misshaped

    def _quick(self, block: bytes, n_lines: int) -> tuple[pa.Table, list[int]] | None:
        """The optimistic split of a block with no line pyarrow must not see; None when it needs the scan."""
        if block.startswith((b"\n", b"\r\n")) or b"\n\n" in block or b"\n\r\n" in block:
            return None
        if b"\r" in block and block.count(b"\r") != block.count(b"\r\n"):
            return None
        if not block.isascii():
            try:
                block.decode("utf-8")
            except UnicodeDecodeError:
                return None
        if self.quote is not None and self.quote.encode() in block:
            last = block[block.rfind(b"\n", 0, len(block) - 1) + 1:].rstrip(b"\n").rstrip(b"\r")
            if split_reference(last.decode("utf-8"), self.dataset) is None:
                return None  # its quote would swallow the block's last newline unseen by the count below
        table, misshaped = self._split(block)
        if None in misshaped or table.num_rows + len(misshaped) != n_lines:
            return None  # a quote ran over a line end
        return table, [k - 1 for k in misshaped if k is not None]

    def _scan(self, block: bytes, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Lines pyarrow must not see: empty, a "\\r" not ending the line, not UTF-8, an unterminated quote."""
        has_cr = (ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13)
        content_ends = ends - has_cr
        suspicious = content_ends == starts
        cr = np.flatnonzero(buf == 13)
        if cr.size:
            line_of = np.searchsorted(ends, cr)
            suspicious[line_of[cr != content_ends[line_of]]] = True
        check = np.zeros(len(starts), dtype=bool)
        high = np.flatnonzero(buf >= 128)
        if high.size:
            check[np.searchsorted(ends, high)] = True
        if self.quote is not None:
            q = np.flatnonzero(buf == ord(self.quote))
            if q.size:
                check[np.searchsorted(ends, q)] = True
        for i in np.flatnonzero(check & ~suspicious):
            raw = block[starts[i] : content_ends[i]]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                suspicious[i] = True
                continue
            if self.quote is not None and split_reference(text, self.dataset) is None:
                suspicious[i] = True
        return suspicious

    def parse(self, block: bytes) -> tuple[pa.RecordBatch, list[tuple[int, bytes, str]]]:
        """Parse whole lines. Returns (good rows, [(line index in block, raw line, reason)])."""
        buf = np.frombuffer(block, dtype=np.uint8)
        n_lines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
        starts = ends = None
        table: pa.Table | None
        quick = self._quick(block, n_lines)
        if quick is not None:
            table, bad_lines = quick
            good_lines = np.delete(np.arange(n_lines), bad_lines) if bad_lines else np.arange(n_lines)
        else:
            starts, ends = line_bounds(buf)
            suspicious = self._scan(block, buf, starts, ends)
            kept = np.flatnonzero(~suspicious)
            bad_lines = [int(i) for i in np.flatnonzero(suspicious)]
            table = None
            good_lines = kept
            if kept.size:
                line_len = np.minimum(ends + 1, buf.size) - starts
                data = buf[np.repeat(~suspicious, line_len)].tobytes() if bad_lines else block
                if not data.endswith(b"\n"):
                    data += b"\n"
                table, misshaped = self._split(data)
                if None in misshaped or table.num_rows + len(misshaped) != kept.size:
                    raise RuntimeError(f"reader: csv split {table.num_rows} + {len(misshaped)} rows, "
                                       f"expected {kept.size}")
                if misshaped:
                    drop = [int(k) - 1 for k in misshaped if k is not None]
                    bad_lines.extend(int(i) for i in kept[drop])
                    good_lines = np.delete(kept, drop)

        bounds = (starts, ends) if starts is not None and ends is not None else None
        return finish_block(block, buf, table, good_lines, bad_lines, bounds, self._convert,
                            empty_batch(self.dataset), lambda raw: parse_row_reference(raw, self.dataset))

    def _convert(self, table: pa.Table) -> tuple[pa.RecordBatch, np.ndarray]:
        return convert_string_columns(
            {c.name: table.column(c.name).combine_chunks() for c in self.specs}, self.specs, self.schema,
            self._ts_cache)


def convert_string_columns(cols: dict[str, pa.Array], specs: list[Any], schema: pa.Schema,
                           ts_cache: dict[str, int | None]) -> tuple[pa.RecordBatch, np.ndarray]:
    """String columns (null = empty) -> the typed batch and the mask of rows with a bad value."""
    n = len(next(iter(cols.values())))
    row_bad = np.zeros(n, dtype=bool)
    arrays: list[pa.Array] = []
    for spec in specs:
        col = cols[spec.name]
        if isinstance(spec, LabelColumn):
            pos = np.asarray(pc.fill_null(pc.is_in(col, value_set=pa.array(spec.positive)), False)
                             .to_numpy(zero_copy_only=False), dtype=bool)
            neg = np.asarray(pc.fill_null(pc.is_in(col, value_set=pa.array(spec.negative)), False)
                             .to_numpy(zero_copy_only=False), dtype=bool)
            row_bad |= ~(pos | neg)
            arrays.append(pa.array(pos.astype(np.int8), type=pa.int8()))
            continue
        if isinstance(spec, TimestampColumn):
            values, bad = enc.vec_timestamp(col, spec.format, ts_cache)
            bad = bad | np.asarray(pc.is_null(values).to_numpy(zero_copy_only=False), dtype=bool)
        elif isinstance(spec, MultiHotFeature):
            values, bad = enc.vec_multi_hot(col, spec.encoding, spec.delimiter)
        elif isinstance(spec, DenseFeature):
            values, bad = enc.vec_float(col) if spec.dtype == "float" else enc.vec_int(col)
        else:
            values, bad = enc.vec_ids(col, spec.encoding)
        row_bad |= bad
        arrays.append(values)
    return pa.RecordBatch.from_arrays(arrays, schema=schema), row_bad


# ---------------------------------------------------------------------------------------------- entry point


def read_text(
    path: Path,
    dataset: DatasetConfig,
    quarantine: Quarantine,
    batch_rows: int = 65536,
    *,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Valid rows of a tsv/csv file in batches of `batch_rows` (the last may be shorter); bad rows quarantined."""
    parser = TextBlockParser(dataset)
    source = RawInput(path, dataset.compression)

    def parsed() -> Iterator[pa.RecordBatch]:
        lines_before = 0
        need_header = dataset.header
        for block in line_blocks(source, BLOCK_BYTES):
            if need_header and block:
                cut = block.find(b"\n")
                header, block = (block, b"") if cut < 0 else (block[:cut], block[cut + 1:])
                check_header(header, dataset, path)
                need_header = False
                lines_before = 1
            if block:
                batch, rejected = parser.parse(block)
                for i, raw, reason in rejected:
                    quarantine.add(path, lines_before + i + 1, reason, raw)
                lines_before += block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
                yield batch
            if on_progress is not None:
                on_progress(source.disk_pos())
        if need_header:
            raise DataError(f"{path}: the schema says the file has a header line, but the file is empty",
                            path=path)

    try:
        yield from rebatch(parsed(), batch_rows)
    finally:
        source.close()
