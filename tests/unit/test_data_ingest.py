"""recforge.data.ingest / manifest / shards: shards + manifest + quarantine, errors, idempotence, range reads."""
from __future__ import annotations

import gzip
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recforge.config import criteo_kaggle_dataset
from recforge.data import DataError, Manifest, Quarantine, generate_days, ingest, read_criteo, read_rows
from recforge.data.schema import arrow_schema

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "criteo_kaggle_sample.tsv"  # tests/data/README.md
DS = criteo_kaggle_dataset()
SAMPLE_LINES = SAMPLE.read_text().splitlines()


def with_bad_lines(path: Path, every: int) -> int:
    """The sample with I3 of every `every`-th line replaced by 'abc'; returns the number of bad lines."""
    lines = list(SAMPLE_LINES)
    bad = 0
    for i in range(0, len(lines), every):
        fields = lines[i].split("\t")
        fields[3] = "abc"
        lines[i] = "\t".join(fields)
        bad += 1
    path.write_text("\n".join(lines) + "\n")
    return bad


def read_all_shards(out: Path) -> pa.Table:
    m = Manifest.load(out)
    return pa.concat_tables([pq.read_table(m.shard_path(i)) for i in range(len(m.shards))])


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_ingest_sample_and_bad_rows(tmp_path):
    bad_src = tmp_path / "bad.tsv.gz"
    plain = tmp_path / "bad.tsv"
    n_bad = with_bad_lines(plain, every=10)
    bad_src.write_bytes(gzip.compress(plain.read_bytes()))
    out = tmp_path / "out"
    m = ingest([SAMPLE, bad_src], DS, out, rows_per_shard=150, max_bad_fraction=0.2)

    assert m.total_rows == 200 + 200 - n_bad
    assert m.quarantined_rows == n_bad == 20
    assert [s.rows for s in m.shards] == [150, 150, 80]
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json", "part-00000.parquet", "part-00001.parquet", "part-00002.parquet", "quarantine.jsonl"]
    assert m.sources == [str(SAMPLE.resolve()), str(bad_src.resolve())]
    assert [(s.rows, s.quarantined_rows) for s in m.source_stats] == [(200, 0), (180, 20)]
    records = list(Quarantine.records(out / "quarantine.jsonl"))
    assert [r["line"] for r in records] == list(range(1, 201, 10))
    assert {r["reason"] for r in records} == {"I3: not an integer: 'abc'"}
    assert all(r["file"] == str(bad_src) for r in records)

    table = read_all_shards(out)
    assert table.schema == arrow_schema(DS)
    with Quarantine(tmp_path / "q.jsonl") as q:
        direct = pa.Table.from_batches(list(read_criteo(SAMPLE, DS, q)) + list(read_criteo(bad_src, DS, q)))
    assert table.to_pylist() == direct.to_pylist()
    m.verify()
    assert Manifest.load(out) == m
    assert leftovers(tmp_path) == []


def test_bad_fraction_above_limit_fails_and_leaves_nothing(tmp_path):
    src = tmp_path / "bad.tsv"
    with_bad_lines(src, every=10)  # 20 of 200 = 10%
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        ingest([SAMPLE, src], DS, out, rows_per_shard=100, max_bad_fraction=0.05)
    msg = str(err.value)
    assert str(src) in msg and "20 bad rows of 200" in msg and "max_bad_fraction=0.05" in msg
    assert "I3: not an integer" in msg
    assert not out.exists()
    assert leftovers(tmp_path) == []
    # the same input under a looser limit passes
    assert ingest([src], DS, out, rows_per_shard=100, max_bad_fraction=0.1).quarantined_rows == 20


def test_failed_reingest_keeps_previous_output(tmp_path):
    out = tmp_path / "out"
    first = ingest([SAMPLE], DS, out, rows_per_shard=100, max_bad_fraction=0.0)
    src = tmp_path / "bad.tsv"
    with_bad_lines(src, every=2)
    with pytest.raises(DataError):
        ingest([src], DS, out, rows_per_shard=100, max_bad_fraction=0.0)
    assert Manifest.load(out) == first
    first.verify()


def test_missing_empty_and_all_bad_sources(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        ingest([SAMPLE, tmp_path / "nope.tsv"], DS, out, rows_per_shard=100, max_bad_fraction=0.01)
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty.*empty.tsv"):
        ingest([empty], DS, out, rows_per_shard=100, max_bad_fraction=0.01)
    empty_gz = tmp_path / "empty.tsv.gz"
    empty_gz.write_bytes(gzip.compress(b""))
    with pytest.raises(DataError, match="no rows.*empty.tsv.gz"):
        ingest([empty_gz], DS, out, rows_per_shard=100, max_bad_fraction=0.01)
    all_bad = tmp_path / "all_bad.tsv"
    all_bad.write_text("a\tb\n1\t2\n")
    with pytest.raises(DataError, match=r"all_bad.tsv: all 2 rows are bad.*wrong field count: expected 40, got 2"):
        ingest([all_bad], DS, out, rows_per_shard=100, max_bad_fraction=1.0)
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_reingest_is_idempotent(tmp_path):
    out = tmp_path / "out"
    a = ingest([SAMPLE], DS, out, rows_per_shard=64, max_bad_fraction=0.0)
    b = ingest([SAMPLE], DS, out, rows_per_shard=64, max_bad_fraction=0.0)
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
    assert a == b
    assert b.total_rows == 200 and read_all_shards(out).num_rows == 200
    assert sorted(p.name for p in out.glob("part-*")) == [f"part-{i:05d}.parquet" for i in range(4)]
    assert leftovers(tmp_path) == []


def test_verify_detects_corrupted_shard(tmp_path):
    out = tmp_path / "out"
    m = ingest([SAMPLE], DS, out, rows_per_shard=100, max_bad_fraction=0.0)
    m.verify()
    shard = m.shard_path(1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard 1 \(part-00001.parquet\) checksum mismatch"):
        m.verify()
    shard.unlink()
    with pytest.raises(DataError, match=r"shard 1 \(part-00001.parquet\) is missing"):
        Manifest.load(out).verify()


def test_read_rows_across_row_groups(tmp_path):
    gen = generate_days(DS, tmp_path / "raw", days=1, rows_per_day=20_000, seed=3)
    out = tmp_path / "out"
    m = ingest([Path(f) for f in gen.files], DS, out, rows_per_shard=12_000, max_bad_fraction=0.0, progress=True)
    assert [s.rows for s in m.shards] == [12_000, 8_000]
    meta = pq.ParquetFile(m.shard_path(0)).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [8192, 3808]
    full = pq.read_table(m.shard_path(0))
    for start, end in [(0, 10), (8000, 8500), (8191, 8193), (8192, 12_000), (0, 12_000), (11_999, 12_000), (5, 5)]:
        batch = read_rows(out, 0, start, end)
        assert isinstance(batch, pa.RecordBatch)
        assert batch.schema == arrow_schema(DS)
        assert batch.num_rows == end - start
        assert pa.Table.from_batches([batch]).equals(full.slice(start, end - start).combine_chunks())
    second = read_rows(out, 1, 7990, 8000)
    assert second.num_rows == 10
    with pytest.raises(IndexError, match="out of range"):
        read_rows(out, 1, 7990, 8001)
    with pytest.raises(IndexError):
        read_rows(out, 2, 0, 1)


def test_read_rows_keeps_no_arrow_memory_per_open_shard(tmp_path):
    """A reader walking a day's shards (the trainer, evaluate) keeps each shard open in a cache; an open shard must
    not hold the bytes of its last read (Parquet's pre_buffer cache did: ~3 MB per 50k-row shard, growing with the
    day up to the cache's size)."""
    import gc

    gen = generate_days(DS, tmp_path / "raw", days=1, rows_per_day=24_000, seed=5)
    out = tmp_path / "out"
    m = ingest([Path(f) for f in gen.files], DS, out, rows_per_shard=10_000, max_bad_fraction=0.0)
    assert len(m.shards) == 3
    gc.collect()
    base = pa.total_allocated_bytes()
    rows = 0
    for i, shard in enumerate(m.shards):
        batch = read_rows(out, i, 0, shard.rows)  # every row group of the shard in one read
        rows += batch.num_rows
        assert batch.nbytes > 100_000  # the read itself did allocate
        del batch
    gc.collect()
    assert rows == 24_000
    assert pa.total_allocated_bytes() - base < 16 * 1024, "open shards hold arrow memory after their reads"
