"""Row-range reads of ingested shards (the trainer's data-shard tasks)."""
from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recforge.data.manifest import MANIFEST_NAME, Manifest


@functools.lru_cache(maxsize=16)
def _manifest(directory: str, stamp: tuple[int, int, int]) -> Manifest:
    return Manifest.load(directory)


class _OpenShard:
    def __init__(self, path: Path):
        # pre_buffer off: with it, the reader keeps the coalesced byte ranges of its last multi-row-group read
        # (~3 MB per 50k-row shard) for as long as the file stays open in the cache below, so a reader walking a
        # day's shards grew by ~3 MB per shard up to the cache's 64 files (docs/performance.md, scale). Local shard
        # files read as fast without it.
        self.file = pq.ParquetFile(path, pre_buffer=False)
        meta = self.file.metadata
        self.num_rows = meta.num_rows
        # first row of each row group, plus the end
        self.starts = np.concatenate(([0], np.cumsum([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])))


@functools.lru_cache(maxsize=64)
def _open(path: str, stamp: tuple[int, int, int]) -> _OpenShard:
    return _OpenShard(Path(path))


def _stamp(path: Path) -> tuple[int, int, int]:
    """Identity of a file version: a re-ingest (new inode / mtime / size) invalidates the caches."""
    st = path.stat()
    return st.st_ino, st.st_mtime_ns, st.st_size


def open_manifest(manifest_dir: str | Path) -> Manifest:
    """Manifest.load with a per-process cache (reloaded when manifest.json changes)."""
    directory = Path(manifest_dir).resolve()
    return _manifest(str(directory), _stamp(directory / MANIFEST_NAME))


def read_rows(manifest_dir: str | Path, shard_index: int, row_start: int, row_end: int) -> pa.RecordBatch:
    """Rows [row_start, row_end) of shard `shard_index`, reading only the row groups that hold them."""
    manifest = open_manifest(manifest_dir)
    path = manifest.shard_path(shard_index)
    shard = _open(str(path), _stamp(path))
    if not 0 <= row_start <= row_end <= shard.num_rows:
        raise IndexError(
            f"read_rows: rows [{row_start}, {row_end}) out of range for shard {shard_index} ({path.name}) "
            f"with {shard.num_rows} rows"
        )
    schema = shard.file.schema_arrow
    if row_start == row_end:
        return pa.RecordBatch.from_arrays([pa.array([], type=f.type) for f in schema], schema=schema)
    first = int(np.searchsorted(shard.starts, row_start, side="right")) - 1
    last = int(np.searchsorted(shard.starts, row_end, side="left")) - 1
    table = shard.file.read_row_groups(list(range(first, last + 1)), use_threads=False)
    table = table.slice(row_start - int(shard.starts[first]), row_end - row_start)
    return table.combine_chunks().to_batches()[0]


def iter_shard(manifest_dir: str | Path, shard_index: int, slab_rows: int) -> Iterator[pa.RecordBatch]:
    """Every row of shard `shard_index` in order, at most `slab_rows` at a time, from a file opened for this walk
    only and closed after it. For one-pass readers of a whole day (evaluate): read_rows keeps its last 64 files
    open (their footers, ~0.3 MB each), which a walk over a day's shards would fill for nothing."""
    if slab_rows < 1:
        raise ValueError(f"slab_rows must be >= 1, got {slab_rows}")
    path = open_manifest(manifest_dir).shard_path(shard_index)
    with pq.ParquetFile(path, pre_buffer=False) as f:
        yield from f.iter_batches(batch_size=slab_rows, use_threads=False)
