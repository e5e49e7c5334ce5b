"""Reader for raw Criteo day files (tab-separated, no header, optionally gzip).

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

import gzip
import io
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from recforge.config import DatasetConfig
from recforge.data.errors import DataError
from recforge.data.quarantine import Quarantine
from recforge.data.schema import arrow_schema, column_names, empty_batch

GZIP_MAGIC = b"\x1f\x8b\x08"  # gzip magic + deflate, the only method gzip defines
BLOCK_BYTES = 8 << 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_HEX_DIGITS = 8

_INT_RE = re.compile(r"-?[0-9]+", re.ASCII)
_HEX_RE = re.compile(r"[0-9a-fA-F]+", re.ASCII)

# byte -> nibble value, 255 for a byte that is not a hex digit
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
# two bytes (as little-endian uint16: first char in the low byte) -> their byte value, 0xFFFF if invalid
_HEX_PAIR_LUT = np.full(1 << 16, 0xFFFF, dtype=np.uint16)
_valid = np.flatnonzero(_HEX_LUT != 255)
_HEX_PAIR_LUT[(_valid[:, None] | (_valid[None, :] << 8)).ravel()] = (
    _HEX_LUT[_valid][:, None].astype(np.uint16) * 16 + _HEX_LUT[_valid][None, :]
).ravel()
# bytes allowed anywhere in a decimal integer field ("-" position is checked by the cast)
_DEC_OK = np.zeros(256, dtype=bool)
_DEC_OK[list(b"0123456789-")] = True


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


# ----------------------------------------------------------------------------------------------
# input


def is_gzip(path: str | Path) -> bool:
    """A ".gz" name, or a file that starts with gzip's header: such a file is read as gzip (a text row
    cannot start with the control bytes 1f 8b), and a broken one is a DataError naming the file."""
    path = Path(path)
    if path.suffix == ".gz":
        return True
    with open(path, "rb") as fh:
        return fh.read(len(GZIP_MAGIC)) == GZIP_MAGIC


class _RawInput:
    """Decompressed byte stream of a day file plus the position in the file on disk (for progress)."""

    def __init__(self, path: Path):
        self.path = path
        self._fh = open(path, "rb")
        self._stream: io.BufferedIOBase = gzip.GzipFile(fileobj=self._fh, mode="rb") if is_gzip(path) else self._fh

    def read(self, n: int) -> bytes:
        try:
            return self._stream.read(n)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise DataError(f"{self.path}: corrupt or truncated gzip file: {exc}") from exc

    def disk_pos(self) -> int:
        return self._fh.tell()

    def close(self) -> None:
        if self._stream is not self._fh:
            self._stream.close()
        self._fh.close()


# ----------------------------------------------------------------------------------------------
# vectorized column parsers (on pyarrow string arrays of the well-shaped lines)


def _string_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, starts, ends) of a pyarrow string array; null entries have start == end."""
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    data_buf = arr.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return data, offsets[:-1], offsets[1:]


def _parse_hex(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (values int64, null mask, bad mask). Empty/null entries are null, not bad."""
    data, starts, ends = _string_parts(arr)
    lens = ends - starts
    null = lens == 0
    n = len(arr)
    values = np.zeros(n, dtype=np.int64)
    bad = np.zeros(n, dtype=bool)
    present = ~null
    m = n - int(null.sum())
    if m == 0:
        return values, null, bad
    if int(ends[-1] - starts[0]) == MAX_HEX_DIGITS * m and lens.max() == MAX_HEX_DIGITS:
        # every present value has exactly 8 digits: the column's data is a dense [m, 8] byte matrix
        chars = data[starts[0] : ends[-1]]
    else:  # right-align each value in 8 bytes, padded with "0" (which is a valid digit)
        bad |= lens > MAX_HEX_DIGITS
        idx = ends[present][:, None] - MAX_HEX_DIGITS + np.arange(MAX_HEX_DIGITS)
        inside = idx >= starts[present][:, None]
        chars = np.where(inside, data[np.maximum(idx, 0)], np.uint8(48)).astype(np.uint8)
    pairs = _HEX_PAIR_LUT[np.ascontiguousarray(chars).view("<u2")].reshape(m, MAX_HEX_DIGITS // 2)
    if pairs.max() > 255:
        bad[present] |= (pairs > 255).any(axis=1)
    values[present] = pairs.astype(np.uint8).view(">u4").ravel()
    values[bad] = 0
    return values, null, bad


def _parse_dense(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """-> (int64 array, nulls where missing or bad; bad mask). Grammar: -?[0-9]+ within int64."""
    data, starts, ends = _string_parts(arr)
    if data.size == 0 or _DEC_OK[data[starts[0] : ends[-1]]].all():
        try:  # arrow's cast accepts exactly -?[0-9]+ in range once "x"/"X" etc. are excluded above
            return pc.cast(arr, pa.int64()), np.zeros(len(arr), dtype=bool)
        except pa.ArrowInvalid:
            pass
    ok = pc.fill_null(pc.match_substring_regex(arr, r"^-?[0-9]{1,18}$"), True).to_numpy(zero_copy_only=False)
    ok = np.asarray(ok, dtype=bool)
    # 19+ digit candidates: decide the int64 range per value (rare)
    for i in np.flatnonzero(~ok):
        s = arr[int(i)].as_py()
        if _INT_RE.fullmatch(s) and INT64_MIN <= int(s) <= INT64_MAX:
            ok[i] = True
    bad = ~ok
    cleaned = pc.if_else(pa.array(bad), pa.scalar(None, pa.string()), arr)
    return pc.cast(cleaned, pa.int64()), bad


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

    @staticmethod
    def _line_bounds(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nl = np.flatnonzero(buf == 10)
        ends = nl if (buf.size and buf[-1] == 10) else np.append(nl, buf.size)
        starts = np.concatenate(([0], nl + 1))[: ends.size]
        return starts, ends

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
            starts, ends = self._line_bounds(buf)
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

        if table is not None and table.num_rows:
            batch, row_bad = self._convert(table)
            if row_bad.any():
                bad_lines.extend(int(i) for i in good_lines[row_bad])
                batch = batch.filter(pa.array(~row_bad))
        else:
            batch = empty_batch(self.dataset)

        rejected = []
        if bad_lines:
            if starts is None or ends is None:
                starts, ends = self._line_bounds(buf)
            for i in sorted(bad_lines):
                raw = block[starts[i] : ends[i]]
                values, reason = parse_line_reference(raw, self.dataset)
                if reason is None:
                    raise RuntimeError(f"reader: fast path rejected a row the reference accepts: {raw!r}")
                rejected.append((i, raw, reason))
        return batch, rejected

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
    source = _RawInput(path)
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    lines_before = 0
    carry = b""
    try:
        while True:
            chunk = source.read(BLOCK_BYTES)
            eof = not chunk
            data = carry + chunk
            if not eof:
                cut = data.rfind(b"\n")
                if cut < 0:
                    carry = data
                    continue
                block, carry = data[: cut + 1], data[cut + 1 :]
            else:
                block, carry = data, b""
            if block:
                batch, rejected = parser.parse(block)
                for i, raw, reason in rejected:
                    quarantine.add(path, lines_before + i + 1, reason, raw)
                lines_before += block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
                if batch.num_rows:
                    pending.append(batch)
                    pending_rows += batch.num_rows
                while pending_rows >= batch_rows:
                    table = pa.Table.from_batches(pending)
                    head, rest = table.slice(0, batch_rows), table.slice(batch_rows)
                    yield head.combine_chunks().to_batches()[0]
                    pending = rest.combine_chunks().to_batches() if rest.num_rows else []
                    pending_rows -= batch_rows
            if on_progress is not None:
                on_progress(source.disk_pos())
            if eof:
                break
        if pending_rows:
            yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]
    finally:
        source.close()


def read_criteo_table(path: str | Path, dataset: DatasetConfig, quarantine: Quarantine) -> pa.Table:
    """All valid rows of one file as a Table (convenience for small files and tests)."""
    batches = list(read_criteo(path, dataset, quarantine))
    return pa.Table.from_batches(batches, schema=arrow_schema(dataset))
