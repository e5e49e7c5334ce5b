"""Ingest raw day files of any schema (data.reader.read_source) into Parquet shards + manifest, quarantining bad rows.

With a timestamp column, the manifest counts the rows per UTC day (`rows_by_day`, also per source file).

Everything is written into a temporary sibling directory that is renamed over `out_dir` only on
success, so a failed run leaves no partial output and a re-run replaces the previous result.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from recforge.config import DatasetConfig
from recforge.data.errors import DataError
from recforge.data.manifest import Manifest, ShardInfo, SourceStats, file_sha256
from recforge.data.quarantine import Quarantine
from recforge.data.reader import read_source
from recforge.data.schema import arrow_schema

log = logging.getLogger(__name__)

ROW_GROUP_ROWS = 8192
QUARANTINE_NAME = "quarantine.jsonl"


def shard_name(i: int) -> str:
    return f"part-{i:05d}.parquet"


class ShardWriter:
    """Splits a stream of batches into shards of `rows_per_shard` rows, row groups of ROW_GROUP_ROWS."""

    def __init__(self, directory: Path, schema: pa.Schema, rows_per_shard: int, row_group_rows: int = ROW_GROUP_ROWS):
        self.directory = directory
        self.schema = schema
        self.rows_per_shard = rows_per_shard
        self.row_group_rows = row_group_rows
        self.shards: list[ShardInfo] = []
        self._writer: pq.ParquetWriter | None = None
        self._shard_rows = 0
        self._buffer: list[pa.RecordBatch] = []
        self._buffered = 0

    def write(self, batch: pa.RecordBatch) -> None:
        offset = 0
        while offset < batch.num_rows:
            if self._writer is None:
                path = self.directory / shard_name(len(self.shards))
                self._writer = pq.ParquetWriter(path, self.schema, compression="snappy")
            take = min(self.rows_per_shard - self._shard_rows, batch.num_rows - offset)
            self._buffer.append(batch.slice(offset, take))
            self._buffered += take
            self._shard_rows += take
            offset += take
            self._flush(final=False)
            if self._shard_rows == self.rows_per_shard:
                self._finish_shard()

    def _flush(self, final: bool) -> None:
        while self._buffered >= self.row_group_rows or (final and self._buffered):
            table = pa.Table.from_batches(self._buffer, schema=self.schema)
            n = min(self.row_group_rows, table.num_rows)
            assert self._writer is not None, "rows buffered without an open shard"
            self._writer.write_table(table.slice(0, n), row_group_size=self.row_group_rows)
            rest = table.slice(n)
            self._buffer = rest.to_batches() if rest.num_rows else []
            self._buffered = rest.num_rows

    def _finish_shard(self) -> None:
        self._flush(final=True)
        assert self._writer is not None, "no open shard to finish"
        self._writer.close()
        self._writer = None
        path = self.directory / shard_name(len(self.shards))
        self.shards.append(
            ShardInfo(path=path.name, rows=self._shard_rows, bytes=path.stat().st_size, sha256=file_sha256(path))
        )
        self._shard_rows = 0

    def close(self) -> list[ShardInfo]:
        if self._writer is not None:
            self._finish_shard()
        return self.shards

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@contextlib.contextmanager
def _progress_bar(enabled: bool, sources: list[Path]) -> Iterator[Callable[[int, int], None]]:
    """Yields update(source_index, bytes_done) or a no-op when progress is off."""
    if not enabled:
        yield lambda i, done: None
        return
    with Progress(TextColumn("ingest {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn()) as bar:
        tasks = [bar.add_task(p.name, total=p.stat().st_size) for p in sources]
        yield lambda i, done: bar.update(tasks[i], completed=done)


def _example(q: Quarantine, dataset: DatasetConfig) -> str:
    where = "record" if dataset.format == "parquet" else "line"
    return f" (e.g. {where} {q.last['line']}: {q.last['reason']})" if q.last else ""


def _count_days(batch: pa.RecordBatch, column: str, counts: dict[str, int]) -> None:
    """Add the batch's rows per UTC day (of its timestamp column) to `counts` ("YYYY-MM-DD" -> rows)."""
    secs = pc.cast(batch.column(column), pa.int64()).to_numpy(zero_copy_only=False)
    days, n = np.unique(np.floor_divide(secs, 86400), return_counts=True)
    for d, k in zip(days.tolist(), n.tolist(), strict=True):
        key = str(np.datetime64(d, "D"))
        counts[key] = counts.get(key, 0) + k


def _merge_days(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for day, n in part.items():
            total[day] = total.get(day, 0) + n
    return dict(sorted(total.items()))


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists() or out_dir.is_symlink():
        old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


def ingest(
    sources: list[Path],
    dataset: DatasetConfig,
    out_dir: Path,
    *,
    rows_per_shard: int,
    max_bad_fraction: float,
    batch_rows: int = 65536,
    progress: bool = False,
) -> Manifest:
    """Read, validate and shard `sources` into out_dir/part-NNNNN.parquet + manifest.json + quarantine.jsonl.

    Raises FileNotFoundError for a missing source, DataError for an empty file, a file without a
    single valid row, or a file whose share of bad rows is above `max_bad_fraction`.
    """
    if rows_per_shard < 1:
        raise ValueError(f"ingest: rows_per_shard must be >= 1, got {rows_per_shard}")
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"ingest: max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
    sources = [Path(s) for s in sources]
    if not sources:
        raise ValueError("ingest: no source files given")
    for src in sources:
        if not src.is_file():
            raise FileNotFoundError(f"ingest: source file not found: {src}")
    for src in sources:
        if src.stat().st_size == 0:
            raise DataError(f"ingest: source file is empty: {src}")

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    writer = ShardWriter(tmp, arrow_schema(dataset), rows_per_shard, ROW_GROUP_ROWS)
    stats: list[SourceStats] = []
    try:
        with Quarantine(tmp / QUARANTINE_NAME) as q, _progress_bar(progress, sources) as update:
            for i, src in enumerate(sources):
                t0 = time.perf_counter()
                bad_before, good = q.count, 0
                by_day: dict[str, int] = {}
                ts = dataset.timestamp
                for batch in read_source(src, dataset, q, batch_rows, on_progress=functools.partial(update, i)):
                    writer.write(batch)
                    good += batch.num_rows
                    if ts is not None and batch.num_rows:
                        _count_days(batch, ts.name, by_day)
                bad = q.count - bad_before
                total = good + bad
                if total == 0:
                    raise DataError(f"ingest: source file has no rows: {src}")
                if good == 0:
                    raise DataError(
                        f"ingest: {src}: all {total} rows are bad ({bad} bad rows of {total}, "
                        f"max_bad_fraction={max_bad_fraction}){_example(q, dataset)}"
                    )
                if bad / total > max_bad_fraction:
                    raise DataError(
                        f"ingest: {src}: {bad} bad rows of {total} ({bad / total:.3%}) is above "
                        f"max_bad_fraction={max_bad_fraction}{_example(q, dataset)}"
                    )
                dt = time.perf_counter() - t0
                log.info("ingest %s: %d rows, %d quarantined, %.1fs (%.0f rows/s)", src, good, bad, dt,
                         total / max(dt, 1e-9))
                stats.append(SourceStats(path=str(src.resolve()), rows=good, quarantined_rows=bad,
                                         rows_by_day=dict(sorted(by_day.items()))))
            shards = writer.close()
            quarantined = q.count
        manifest = Manifest(
            dataset=dataset,
            shards=shards,
            total_rows=sum(s.rows for s in shards),
            quarantined_rows=quarantined,
            sources=[s.path for s in stats],
            source_stats=stats,
            rows_by_day=_merge_days(s.rows_by_day for s in stats),
        )
        manifest.save(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Manifest.load(out_dir)
