"""Raw bytes of a text day file: gzip by setting, name or content, a UTF-8 BOM at the start dropped, whole-line
blocks; parsed blocks' rows regrouped into batches of a fixed size. A corrupt or truncated gzip stream is a
DataError naming the file."""
from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from recforge.data.errors import DataError

GZIP_MAGIC = b"\x1f\x8b\x08"  # gzip magic + deflate, the only method gzip defines
UTF8_BOM = b"\xef\xbb\xbf"


def is_gzip(path: str | Path, compression: str = "auto") -> bool:
    """`compression` "gzip"/"none" decide; "auto": a ".gz" name, or a file that starts with gzip's header (a text
    row cannot start with the control bytes 1f 8b)."""
    if compression != "auto":
        return compression == "gzip"
    path = Path(path)
    if path.suffix == ".gz":
        return True
    with open(path, "rb") as fh:
        return fh.read(len(GZIP_MAGIC)) == GZIP_MAGIC


class RawInput:
    """Decompressed byte stream of a day file plus the position in the file on disk (for progress)."""

    def __init__(self, path: Path, compression: str = "auto"):
        self.path = path
        self._fh = open(path, "rb")
        self._stream: io.BufferedIOBase = (
            gzip.GzipFile(fileobj=self._fh, mode="rb") if is_gzip(path, compression) else self._fh)
        self._first = True

    def _read(self, n: int) -> bytes:
        try:
            return self._stream.read(n)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise DataError(f"{self.path}: corrupt or truncated gzip file: {exc}", path=self.path) from exc

    def read(self, n: int) -> bytes:
        data = self._read(n)
        if self._first:
            self._first = False
            while data and len(data) < len(UTF8_BOM) and UTF8_BOM.startswith(data):
                more = self._read(n)
                if not more:
                    break
                data += more
            if data.startswith(UTF8_BOM):
                data = data[len(UTF8_BOM):]
        return data

    def disk_pos(self) -> int:
        return self._fh.tell()

    def close(self) -> None:
        if self._stream is not self._fh:
            self._stream.close()
        self._fh.close()


def line_blocks(source: RawInput, block_bytes: int) -> Iterator[bytes]:
    """Blocks of whole lines (the last one may lack its "\\n"); an empty bytes object once at the end."""
    carry = b""
    while True:
        chunk = source.read(block_bytes)
        if not chunk:
            if carry:
                yield carry
            yield b""
            return
        data = carry + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            carry = data
            continue
        yield data[: cut + 1]
        carry = data[cut + 1:]


def rebatch(batches: Iterator[pa.RecordBatch], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The rows of `batches` (one per parsed block) in batches of exactly `batch_rows` (the last may be shorter)."""
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    for batch in batches:
        if batch.num_rows:
            pending.append(batch)
            pending_rows += batch.num_rows
        while pending_rows >= batch_rows:
            table = pa.Table.from_batches(pending)
            head, rest = table.slice(0, batch_rows), table.slice(batch_rows)
            yield head.combine_chunks().to_batches()[0]
            pending = rest.combine_chunks().to_batches() if rest.num_rows else []
            pending_rows -= batch_rows
    if pending_rows:
        yield pa.Table.from_batches(pending).combine_chunks().to_batches()[0]
