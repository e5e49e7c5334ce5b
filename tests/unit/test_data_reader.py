"""recforge.data.reader: the real Criteo sample, a corpus of bad rows, and fast path vs reference."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from recforge.config import DatasetConfig, DenseFeature, SparseFeature, criteo_kaggle_dataset
from recforge.data import reader as reader_mod
from recforge.data.errors import DataError
from recforge.data.quarantine import Quarantine
from recforge.data.reader import GZIP_MAGIC, parse_line_reference, read_criteo
from recforge.data.schema import arrow_schema

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "criteo_kaggle_sample.tsv"  # tests/data/README.md
DS = criteo_kaggle_dataset()


def read_all(path, dataset=DS, batch_rows=65536, qpath=None):
    qpath = qpath or Path(path).with_name(Path(path).name + ".quarantine.jsonl")
    with Quarantine(qpath) as q:
        batches = list(read_criteo(path, dataset, q, batch_rows=batch_rows))
    table = pa.Table.from_batches(batches, schema=arrow_schema(dataset))
    return table, list(Quarantine.records(qpath)), batches


def make_line(label="0", dense=None, sparse=None, dataset=DS):
    dense = dense or {}
    sparse = sparse or {}
    fields = [label]
    fields += [dense.get(n, str(i)) for i, n in enumerate(dataset.dense_names)]
    fields += [sparse.get(n, f"{0x1000 + i:08x}") for i, n in enumerate(dataset.sparse_names)]
    return "\t".join(fields)


# ---------------------------------------------------------------------------------------------- sample


def test_sample_parses_exactly(tmp_path):
    assert SAMPLE.is_file(), f"sample missing: {SAMPLE}"
    table, quarantined, _ = read_all(SAMPLE, qpath=tmp_path / "q.jsonl")
    assert quarantined == []
    assert table.num_rows == 200
    assert table.schema == arrow_schema(DS)
    labels = table.column("label").to_pylist()
    assert labels.count(0) == 151 and labels.count(1) == 49

    first_text = SAMPLE.read_bytes().split(b"\n")[0].decode()
    fields = first_text.split("\t")
    assert len(fields) == 40  # trailing empty fields still count: 39 tabs
    row = table.slice(0, 1).to_pylist()[0]
    # cells of the first line, checked against the file text
    assert fields[1] == "" and row["I1"] is None
    assert fields[2] == "3" and row["I2"] == 3
    assert fields[3] == "260" and row["I3"] == 260
    assert fields[14] == "05db9164" and row["C1"] == 0x05DB9164
    assert fields[16] == "9143c832" and row["C3"] == 0x9143C832 > 2**31  # unsigned 32-bit
    assert fields[32] == "" and row["C19"] is None
    assert fields[39] == "" and row["C26"] is None
    # the second line has I2 = -1
    assert table.column("I2")[1].as_py() == -1


def test_sample_matches_reference_and_batches(tmp_path):
    table, _, batches = read_all(SAMPLE, batch_rows=64, qpath=tmp_path / "q.jsonl")
    assert [b.num_rows for b in batches] == [64, 64, 64, 8]
    lines = SAMPLE.read_bytes().split(b"\n")[:-1]
    expected = [parse_line_reference(line, DS)[0] for line in lines]
    assert [list(r.values()) for r in table.to_pylist()] == expected


def test_sample_missing_share_is_plausible(tmp_path):
    table, _, _ = read_all(SAMPLE, qpath=tmp_path / "q.jsonl")
    # C19/C20/C22/C25/C26 are often missing in Criteo; C1 never
    assert table.column("C1").null_count == 0
    assert table.column("C22").null_count > 100


# ---------------------------------------------------------------------------------------------- bad rows

GOOD = make_line()
BAD_CASES = [  # (line text or bytes, expected reason)
    (make_line()[: make_line().rfind("\t")], "wrong field count: expected 40, got 39"),
    ("", "wrong field count: expected 40, got 1"),
    (make_line() + "\t", "wrong field count: expected 40, got 41"),
    (make_line(dense={"I3": "abc"}), "I3: not an integer: 'abc'"),
    (make_line(dense={"I1": "0x10"}), "I1: not an integer: '0x10'"),
    (make_line(dense={"I2": "+5"}), "I2: not an integer: '+5'"),
    (make_line(dense={"I4": " 5"}), "I4: not an integer: ' 5'"),
    (make_line(dense={"I6": "1.5"}), "I6: not an integer: '1.5'"),
    (make_line(dense={"I5": "9223372036854775808"}), "I5: integer out of int64 range: '9223372036854775808'"),
    (make_line(dense={"I7": "-9223372036854775809"}), "I7: integer out of int64 range: '-9223372036854775809'"),
    (make_line(sparse={"C2": "zz"}), "C2: invalid hex: 'zz'"),
    (make_line(sparse={"C2": "0x1f"}), "C2: invalid hex: '0x1f'"),
    (make_line(sparse={"C3": "123456789"}), "C3: hex longer than 8 digits: '123456789'"),
    (make_line(sparse={"C5": "caf\u00e9"}), "C5: invalid hex: 'caf\u00e9'"),
    (make_line(label="2"), "label: not 0/1: '2'"),
    (make_line(label=""), "label: not 0/1: ''"),
    (make_line(sparse={"C4": "ab\rcd"}), "C4: invalid hex: 'ab\\rcd'"),
    (make_line(dense={"I3": "x"}, sparse={"C1": "g"}), "I3: not an integer: 'x'; C1: invalid hex: 'g'"),
    (make_line(sparse={"C4": "__FF__"}).encode().replace(b"__FF__", b"ab\xffcd"),
     "C4: undecodable bytes (not UTF-8): 'ab\\\\xffcd'"),
]
GOOD_EDGE = [  # valid lines at the edges of the grammar, with the value expected in one column
    (make_line(dense={"I5": "9223372036854775807"}), "I5", 2**63 - 1),
    (make_line(dense={"I5": "-9223372036854775808"}), "I5", -(2**63)),
    (make_line(dense={"I2": "-2"}), "I2", -2),
    (make_line(dense={"I2": "007"}), "I2", 7),
    (make_line(sparse={"C7": "ABCDEF12"}), "C7", 0xABCDEF12),
    (make_line(sparse={"C7": "ffffffff"}), "C7", 2**32 - 1),
    (make_line(sparse={"C7": "1"}), "C7", 1),
    (make_line(dense={"I13": ""}, sparse={"C26": ""}), "C26", None),
]


def write_corpus(path: Path, compress: bool) -> list[tuple[int, str]]:
    """Good and bad lines interleaved; returns [(line number, reason)] of the bad ones."""
    chunks, expected = [], []
    line_no = 0
    for text, reason in BAD_CASES:
        for item in (GOOD, text):
            line_no += 1
            chunks.append(item.encode() if isinstance(item, str) else item)
        expected.append((line_no, reason))
    for text, _, _ in GOOD_EDGE:
        chunks.append(text.encode())
    chunks.append(GOOD.encode() + b"\r")  # CRLF line ending is a line ending
    data = b"\n".join(chunks) + b"\n"
    path.write_bytes(gzip.compress(data, mtime=0) if compress else data)
    return expected


@pytest.mark.parametrize("name,compress", [("bad.tsv", False), ("bad.tsv.gz", True), ("bad_no_suffix.tsv", True)])
def test_bad_rows_are_quarantined_with_reason_and_line(tmp_path, name, compress):
    path = tmp_path / name
    expected = write_corpus(path, compress)
    table, records, _ = read_all(path, batch_rows=5, qpath=tmp_path / "q.jsonl")
    assert [(r["line"], r["reason"]) for r in records] == expected
    assert all(r["file"] == str(path) for r in records)
    n_good = len(BAD_CASES) + len(GOOD_EDGE) + 1
    assert table.num_rows == n_good
    good_row = parse_line_reference(GOOD.encode(), DS)[0]
    assert [list(r.values()) for r in table.slice(0, len(BAD_CASES)).to_pylist()] == [good_row] * len(BAD_CASES)
    edge_rows = table.slice(len(BAD_CASES), len(GOOD_EDGE)).to_pylist()
    for row, (_, col, value) in zip(edge_rows, GOOD_EDGE, strict=True):
        assert row[col] == value
    assert list(table.slice(n_good - 1).to_pylist()[0].values()) == good_row  # the CRLF line


def test_quarantine_keeps_raw_text(tmp_path):
    path = tmp_path / "bad.tsv"
    write_corpus(path, compress=False)
    _, records, _ = read_all(path, qpath=tmp_path / "q.jsonl")
    by_reason = {r["reason"]: r["raw"] for r in records}
    assert by_reason["I3: not an integer: 'abc'"] == make_line(dense={"I3": "abc"})
    assert "ab\\xffcd" in by_reason["C4: undecodable bytes (not UTF-8): 'ab\\\\xffcd'"]
    # each record is one JSON line
    lines = (tmp_path / "q.jsonl").read_text().splitlines()
    assert len(lines) == len(BAD_CASES) and all(json.loads(x)["line"] >= 1 for x in lines)


def test_last_line_without_newline_and_small_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", 300)  # several blocks, lines cut across reads
    path = tmp_path / "x.tsv"
    lines = [make_line(dense={"I1": str(i)}) for i in range(12)]
    lines[5] = make_line(dense={"I1": "bad"})
    path.write_text("\n".join(lines))  # no final newline
    table, records, _ = read_all(path, batch_rows=4, qpath=tmp_path / "q.jsonl")
    assert [(r["line"], r["reason"]) for r in records] == [(6, "I1: not an integer: 'bad'")]
    assert table.column("I1").to_pylist() == [i for i in range(12) if i != 5]


def test_custom_dataset_layout(tmp_path):
    ds = DatasetConfig(
        name="tiny", label="click",
        dense=[DenseFeature(name="d0")],
        sparse=[SparseFeature(name="s0", cardinality=10), SparseFeature(name="s1", cardinality=10)],
    )
    path = tmp_path / "tiny.tsv"
    path.write_text("1\t-4\tff\t\n0\t\t\t10\n1\t2\tff\n2\t1\t1\t1\n")
    table, records, _ = read_all(path, dataset=ds, qpath=tmp_path / "q.jsonl")
    assert table.column_names == ["click", "d0", "s0", "s1"]
    assert table.to_pylist() == [
        {"click": 1, "d0": -4, "s0": 255, "s1": None},
        {"click": 0, "d0": None, "s0": None, "s1": 16},
    ]
    assert [(r["line"], r["reason"]) for r in records] == [
        (3, "wrong field count: expected 4, got 3"), (4, "click: not 0/1: '2'"),
    ]


def test_corrupt_gzip_is_a_data_error(tmp_path):
    path = tmp_path / "cut.tsv.gz"
    path.write_bytes(gzip.compress((GOOD + "\n").encode() * 50)[:-12])
    with pytest.raises(DataError, match="cut.tsv.gz: corrupt or truncated gzip"):
        read_all(path, qpath=tmp_path / "q.jsonl")


def test_gzip_header_without_suffix(tmp_path):
    """A file named .tsv that starts with gzip's header is read as gzip; a broken one names the file."""
    good = tmp_path / "day.tsv"
    good.write_bytes(gzip.compress((GOOD + "\n").encode() * 3))
    assert read_all(good, qpath=tmp_path / "a.jsonl")[0].num_rows == 3
    bad = tmp_path / "odd.tsv"
    bad.write_bytes(GZIP_MAGIC + b"\t1\t2\n" + (GOOD + "\n").encode())
    with pytest.raises(DataError, match="odd.tsv: corrupt or truncated gzip"):
        read_all(bad, qpath=tmp_path / "b.jsonl")
    two_bytes = tmp_path / "two.tsv"  # 1f 8b without the deflate byte is no gzip header: parsed as text rows
    two_bytes.write_bytes(b"\x1f\x8b\t1\n" + (GOOD + "\n").encode())
    table, records, _ = read_all(two_bytes, qpath=tmp_path / "c.jsonl")
    assert table.num_rows == 1 and [r["line"] for r in records] == [1]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        list(read_criteo(tmp_path / "nope.tsv", DS, Quarantine(tmp_path / "q.jsonl")))


# ---------------------------------------------------------------------------------------------- fast path vs reference

TINY = DatasetConfig(
    name="tiny", dense=[DenseFeature(name="I1"), DenseFeature(name="I2")],
    sparse=[SparseFeature(name="C1", cardinality=5), SparseFeature(name="C2", cardinality=5)],
)
TOKENS = ["", "0", "1", "-1", "12", "-", "abc", "ff", "FFFFFFFF", "123456789", "0x1", "9223372036854775807",
          "9223372036854775808", "-9223372036854775808", "+3", " 1", "1 ", "\r", "é", "00000000", "deadbeef", "g"]
line_st = st.one_of(
    st.lists(st.sampled_from(TOKENS), min_size=5, max_size=5).map(lambda f: "\t".join(f).encode()),
    st.lists(st.sampled_from(TOKENS), min_size=0, max_size=7).map(lambda f: "\t".join(f).encode()),
    st.binary(max_size=12).filter(lambda b: b"\n" not in b),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(line_st, min_size=1, max_size=30), batch_rows=st.integers(1, 8))
def test_fast_path_matches_reference(tmp_path, lines, batch_rows):
    data = b"\n".join(lines) + b"\n"
    assume(not data.startswith(GZIP_MAGIC))  # such a file is read as gzip: test_gzip_header_without_suffix
    path = tmp_path / "h.tsv"
    path.write_bytes(data)
    table, records, _ = read_all(path, dataset=TINY, batch_rows=batch_rows, qpath=tmp_path / "q.jsonl")
    expected_rows, expected_bad = [], []
    for i, line in enumerate(lines, start=1):
        values, reason = parse_line_reference(line, TINY)
        if reason is None:
            expected_rows.append(values)
        else:
            expected_bad.append((i, reason, line.decode("utf-8", errors="backslashreplace")))
    assert [list(r.values()) for r in table.to_pylist()] == expected_rows
    assert [(r["line"], r["reason"], r["raw"]) for r in records] == expected_bad


@pytest.mark.parametrize("with_oddities", [False, True])
def test_optimistic_split_and_line_scan_agree(tmp_path, monkeypatch, with_oddities):
    """Blocks split optimistically by pyarrow (bad field counts reported by its handler) give the
    same rows and quarantine records as the numpy line scan."""
    cases = [(t, r) for t, r in BAD_CASES
             if with_oddities or (isinstance(t, str) and t and "\r" not in t and t.isascii())]
    lines = []
    for text, _ in cases:
        lines += [GOOD, text]
    path = tmp_path / "c.tsv"
    path.write_bytes(b"\n".join(x.encode() if isinstance(x, str) else x for x in lines) + b"\n")
    normal = read_all(path, batch_rows=3, qpath=tmp_path / "a.jsonl")[:2]
    monkeypatch.setattr(reader_mod._BlockParser, "_try_plain", lambda self, block, buf, n: None)
    scanned = read_all(path, batch_rows=3, qpath=tmp_path / "b.jsonl")[:2]
    assert normal[0].equals(scanned[0]) and normal[1] == scanned[1]
    assert [r["reason"] for r in normal[1]] == [r for _, r in cases]
