"""holdout "split": the last rows of an ingested split become the held-out split (deterministic: by row position, so
the latest rows of the run's day are held out). Shards wholly in the tail are moved, the one the cut falls in is
rewritten as two; everything happens inside the stage's temporary directory, committed with it."""
from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq

from recforge.data.errors import DataError
from recforge.data.ingest import ROW_GROUP_ROWS, shard_name
from recforge.data.manifest import Manifest, ShardInfo, file_sha256


def tail_rows(day_rows: int, fraction: float, what: str) -> int:
    """Rows held out of a day of `day_rows` rows: round(fraction * rows), at least 1, leaving at least 1 to train."""
    n = max(1, round(day_rows * fraction))
    if day_rows - n < 1:
        raise DataError(f"holdout split: {what} has {day_rows} valid row(s), too few to hold out "
                        f"holdout_fraction={fraction:g} and still train on the rest", reason="too few rows")
    return n


def _write(table, path: Path) -> ShardInfo:
    pq.write_table(table, path, row_group_size=ROW_GROUP_ROWS, compression="snappy")
    return ShardInfo(path=path.name, rows=table.num_rows, bytes=path.stat().st_size, sha256=file_sha256(path))


def split_tail(train_dir: Path, holdout_dir: Path, n: int, sources: list[str]) -> tuple[Manifest, Manifest]:
    """Move the last `n` rows of the manifest in `train_dir` into a new manifest in `holdout_dir` (read from
    `sources`); returns both (train, holdout), saved. The train manifest keeps the ingest's counts and quarantine."""
    train = Manifest.load(train_dir)
    if not 0 < n < train.total_rows:
        raise ValueError(f"split_tail: cannot hold out {n} of {train.total_rows} rows")
    holdout_dir.mkdir(parents=True)
    keep, moved, left = list(train.shards), [], n
    while left:
        shard = keep.pop()
        src = train_dir / shard.path
        if shard.rows <= left:  # wholly in the tail: moved as it is
            moved.append((src, shard))
            left -= shard.rows
            continue
        table = pq.read_table(src)  # the cut falls inside this shard: its head stays, its tail goes
        cut = shard.rows - left
        head_path, tail_path = src.with_name(f".{src.name}.head"), holdout_dir / ".tail.parquet"
        head = _write(table.slice(0, cut), head_path)
        moved.append((tail_path, _write(table.slice(cut), tail_path)))
        os.replace(head_path, src)
        keep.append(head.model_copy(update={"path": shard.path}))
        left = 0
    shards = []
    for i, (src, info) in enumerate(reversed(moved)):  # back in row order, renumbered from part-00000
        os.replace(src, holdout_dir / shard_name(i))
        shards.append(info.model_copy(update={"path": shard_name(i)}))
    update: dict = {"shards": keep, "total_rows": sum(s.rows for s in keep)}
    if "rows_by_day" in Manifest.model_fields:  # the ingest's per-day counts no longer hold for either part
        update["rows_by_day"] = {}
    train = train.model_copy(update=update)
    holdout = Manifest(dataset=train.dataset, shards=shards, total_rows=n, quarantined_rows=0, sources=sources)
    train.save(train_dir)
    holdout.save(holdout_dir)
    return train, holdout


def hold_out_tail(train_dir: Path, holdout_dir: Path, run_day_files: list[str],
                  fraction: float) -> tuple[Manifest, Manifest]:
    """holdout split: the last `fraction` of the run day's valid rows (the ingest's last source files) move from
    the train split in `train_dir` to `holdout_dir`; returns (train, holdout) manifests."""
    train = Manifest.load(train_dir)
    wanted = {str(Path(f).resolve()) for f in run_day_files}
    day_rows = sum(s.rows for s in train.source_stats if s.path in wanted)
    n = tail_rows(day_rows, fraction, f"the run's day ({', '.join(run_day_files)})")
    return split_tail(train_dir, holdout_dir, n, sorted(wanted))
