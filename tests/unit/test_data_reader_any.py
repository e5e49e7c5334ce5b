"""recforge.data.reader_text: a user's CSV fixture, gzip, headers, hex64/int TSV, and fast path vs reference."""
from __future__ import annotations

import gzip
import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from recforge.config import DatasetConfig, criteo_kaggle_dataset, load_dataset
from recforge.data import DataError, Manifest, Quarantine, ingest, read_source, string_id
from recforge.data import reader_text as text_mod
from recforge.data.reader import parse_line_reference
from recforge.data.reader_text import parse_row_reference, read_text
from recforge.data.schema import arrow_schema

DATA = Path(__file__).resolve().parents[1] / "data"
CLICKS = DATA / "clicks_sample.csv"
CLICKS_DS = load_dataset(DATA / "schemas" / "clicks_csv.yaml")


def read_all(path, dataset, qpath, batch_rows=65536, reader=read_source):
    with Quarantine(qpath) as q:
        batches = list(reader(Path(path), dataset, q, batch_rows))
    return pa.Table.from_batches(batches, schema=arrow_schema(dataset)), list(Quarantine.records(qpath))


# ---------------------------------------------------------------------------------------------- the user CSV fixture


def test_clicks_fixture_parses_with_exact_counts_and_reasons(tmp_path):
    assert CLICKS.read_bytes().startswith(b"\xef\xbb\xbf")  # the BOM is on the header line
    table, records = read_all(CLICKS, CLICKS_DS, tmp_path / "q.jsonl", batch_rows=64)
    assert table.schema == arrow_schema(CLICKS_DS)
    assert table.column_names[:3] == ["click", "price", "impressions"] and table.column_names[-1] == "hour"
    assert "id" not in table.column_names
    assert [(r["line"], r["reason"]) for r in records] == [
        (22, "wrong field count: expected 13, got 12"),
        (43, "column 'click': label value 'maybe' is neither positive ['1'] nor negative ['0']"),
        (79, "column 'price': not a number: '12x5'"),
        (122, "column 'hour': timestamp '14102x99' does not match format '%y%m%d%H'"),
        (152, "column 'banner_pos': not an integer: 'two'"),
    ]
    lines = CLICKS.read_text(encoding="utf-8-sig").splitlines()
    assert records[1]["raw"] == lines[42] and records[1]["file"] == str(CLICKS)
    assert table.num_rows == 200 - 5
    # every good row equals the reference's parse of its line
    good = [parse_row_reference(line.encode(), CLICKS_DS) for line in lines[1:]]
    assert table.to_pylist() == [v for v, why in good if why is None]
    first = table.slice(0, 1).to_pylist()[0]
    fields = lines[1].split(",")
    assert first["hour"] == datetime(2014, 10, 21, 0, tzinfo=UTC) and fields[1] == "14102100"
    assert first["site_id"] == string_id(fields[4]) and first["price"] == float(fields[10])
    assert first["banner_pos"] == int(fields[3]) and first["tags"] == []
    # a quoted value holding the delimiter, and a multi-hot field
    row10 = table.slice(10, 1).to_pylist()[0]
    assert row10["site_domain"] == string_id("shop, inc")
    tagged = next(r for r, line in zip(table.to_pylist()[:19], lines[1:20], strict=True) if "|" in line)
    assert len(tagged["tags"]) >= 2 and all(isinstance(t, int) for t in tagged["tags"])


def test_clicks_ingest_counts_rows_per_day_and_names_bad_rows(tmp_path):
    m = ingest([CLICKS], CLICKS_DS, tmp_path / "out", rows_per_shard=100, max_bad_fraction=0.05)
    assert m.total_rows == 195 and m.quarantined_rows == 5
    assert m.rows_by_day == {"2014-10-21": 97, "2014-10-22": 98} and m.source_stats[0].rows_by_day == m.rows_by_day
    assert Manifest.load(tmp_path / "out").rows_by_day == m.rows_by_day
    with pytest.raises(DataError, match=r"clicks_sample.csv: 5 bad rows of 200 .* \(e.g. line 152: column "
                                        r"'banner_pos': not an integer: 'two'\)"):
        ingest([CLICKS], CLICKS_DS, tmp_path / "out2", rows_per_shard=100, max_bad_fraction=0.01)


def test_string_id_is_xxh3_64_signed():
    assert string_id("abc") == 8696274497037089104  # xxh3_64(b"abc", seed=0)
    assert string_id("") == 3244421341483603138  # xxh3_64 of no bytes
    assert string_id("café") == string_id("café".encode())
    assert all(-(2**63) <= string_id(s) < 2**63 for s in ["a", "b", "site", "x" * 100])


# ---------------------------------------------------------------------------------------------- headers, gzip, CRLF

SMALL = DatasetConfig.model_validate({
    "name": "small", "format": "csv", "header": True,
    "columns": [{"name": "uid", "role": "ignore"}, {"name": "y", "role": "label", "positive": ["yes"],
                                                    "negative": ["no"]},
                {"name": "x", "role": "dense", "dtype": "float"}, {"name": "c", "role": "categorical",
                                                                   "encoding": "string"}],
})


def test_header_mismatch_names_missing_and_extra_columns(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("uid,y,xx,c,extra\nu1,yes,1.5,a,9\n")
    with pytest.raises(DataError, match=r"h.csv: line 1: header does not match the schema: missing columns \['x'\], "
                                        r"extra columns \['xx', 'extra'\]") as e:
        read_all(path, SMALL, tmp_path / "q.jsonl")
    assert "\n" not in str(e.value) and e.value.row == 1
    path.write_text("y,uid,x,c\nyes,u1,1.5,a\n")
    with pytest.raises(DataError, match="another order"):
        read_all(path, SMALL, tmp_path / "q.jsonl")
    assert list(Quarantine.records(tmp_path / "q.jsonl")) == []


@pytest.mark.parametrize(("name", "compression"), [("d.csv.gz", "auto"), ("d.csv", "auto"), ("d.dat", "gzip")])
def test_gzip_by_name_content_or_setting_and_crlf(tmp_path, name, compression):
    ds = SMALL.model_copy(update={"compression": compression})
    text = "\ufeffuid,y,x,c\r\nu1,yes,1.5,a\r\nu2,no,,b\r\nu3,perhaps,2,c\r\nu4,no,-3e2,\r\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    table, records = read_all(path, ds, tmp_path / "q.jsonl")
    assert table.to_pylist() == [{"y": 1, "x": 1.5, "c": string_id("a")}, {"y": 0, "x": None, "c": string_id("b")},
                                 {"y": 0, "x": -300.0, "c": None}]
    assert [(r["line"], r["raw"]) for r in records] == [(4, "u3,perhaps,2,c\r")]


def test_corrupt_gzip_names_the_file(tmp_path):
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(gzip.compress(b"uid,y,x,c\n" + b"u,yes,1,a\n" * 100)[:-10])
    with pytest.raises(DataError, match="cut.csv.gz: corrupt or truncated gzip"):
        read_all(path, SMALL, tmp_path / "q.jsonl")


def test_header_only_file_has_no_rows_and_empty_file_is_an_error(tmp_path):
    path = tmp_path / "h.csv"
    path.write_text("uid,y,x,c\n")
    assert read_all(path, SMALL, tmp_path / "q.jsonl")[0].num_rows == 0
    (tmp_path / "e.csv").write_bytes(b"")
    with pytest.raises(DataError, match="e.csv: .*header"):
        read_all(tmp_path / "e.csv", SMALL, tmp_path / "q.jsonl")


# ---------------------------------------------------------------------------------------------- TSV, hex64 and int

HEX_TSV = DatasetConfig.model_validate({
    "name": "hex", "format": "tsv",
    "columns": [{"name": "a", "role": "categorical", "encoding": "hex64"}, {"name": "y", "role": "label"},
                {"name": "n", "role": "dense"}, {"name": "b", "role": "categorical", "encoding": "int"},
                {"name": "ts", "role": "timestamp", "format": "unix_ms"}],
})


def test_tsv_without_header_hex64_and_int(tmp_path):
    assert not HEX_TSV.is_criteo_layout
    path = tmp_path / "x.tsv"
    path.write_text("ffffffffffffffff\t1\t5\t-7\t1700000000999\n"
                    "7fffffffffffffff\t0\t\t9223372036854775807\t0\n"
                    "10000000000000000\t0\t1\t1\t0\n"      # 17 hex digits
                    "ab\t0\t1\t1.5\t0\n"                    # int categorical with a fraction
                    "\t1\t-1\t\t-1\n")
    table, records = read_all(path, HEX_TSV, tmp_path / "q.jsonl")
    assert table.to_pylist() == [
        {"y": 1, "n": 5, "a": -1, "b": -7, "ts": datetime.fromtimestamp(1700000000, UTC)},
        {"y": 0, "n": None, "a": 2**63 - 1, "b": 2**63 - 1, "ts": datetime.fromtimestamp(0, UTC)},
        {"y": 1, "n": -1, "a": None, "b": None, "ts": datetime.fromtimestamp(-1, UTC)},
    ]
    assert [(r["line"], r["reason"]) for r in records] == [
        (3, "column 'a': hex longer than 16 digits: '10000000000000000'"),
        (4, "column 'b': not an integer: '1.5'"),
    ]


def test_criteo_sample_through_the_generic_reader_equals_the_fast_path(tmp_path):
    ds = criteo_kaggle_dataset()
    sample = DATA / "criteo_kaggle_sample.tsv"
    fast, _ = read_all(sample, ds, tmp_path / "a.jsonl")
    generic, records = read_all(sample, ds, tmp_path / "b.jsonl", reader=read_text)
    assert records == [] and generic.equals(fast) and fast.num_rows == 200
    line = sample.read_bytes().split(b"\n")[3]
    assert list(parse_row_reference(line, ds)[0].values()) == parse_line_reference(line, ds)[0]


# ---------------------------------------------------------------------------------------------- fast path vs reference

ANY = DatasetConfig.model_validate({
    "name": "any", "format": "csv",
    "columns": [
        {"name": "id", "role": "ignore"},
        {"name": "y", "role": "label", "positive": ["1", "yes"], "negative": ["0"]},
        {"name": "f", "role": "dense", "dtype": "float"},
        {"name": "i", "role": "dense"},
        {"name": "h", "role": "categorical", "encoding": "hex32"},
        {"name": "s", "role": "categorical", "encoding": "string"},
        {"name": "m", "role": "multi_hot", "encoding": "int", "delimiter": "|", "max_length": 3},
        {"name": "t", "role": "timestamp", "format": "%Y%m%d%H"},
    ],
})
TOKENS = ["", "0", "1", "yes", "-1", "1.5", ".5", "1e3", "1e400", "nan", "abc", "ff", "FFFFFFFF", "123456789",
          "9223372036854775808", "2026110314", "2026113314", "202611031", "1|2", "1||2", "|", "x|1", '"a,b"',
          '"q""q"', '"', 'a"b', " 1", "é", "\r", "ab\rc", "2026-11-03"]
line_st = st.one_of(
    st.lists(st.sampled_from(TOKENS), min_size=8, max_size=8).map(lambda f: ",".join(f).encode()),
    st.lists(st.sampled_from(TOKENS), min_size=0, max_size=10).map(lambda f: ",".join(f).encode()),
    st.binary(max_size=12).filter(lambda b: b"\n" not in b),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(line_st, min_size=1, max_size=25), batch_rows=st.integers(1, 6))
def test_generic_fast_path_matches_reference(tmp_path, lines, batch_rows):
    data = b"\n".join(lines) + b"\n"
    assume(not data.startswith((b"\x1f\x8b\x08", b"\xef\xbb\xbf")))  # gzip / BOM: tested above
    path = tmp_path / "h.csv"
    path.write_bytes(data)
    table, records = read_all(path, ANY, tmp_path / "q.jsonl", batch_rows=batch_rows)
    expected_rows, expected_bad = [], []
    for i, line in enumerate(lines, start=1):
        values, reason = parse_row_reference(line, ANY)
        if reason is None:
            expected_rows.append(values)
        else:
            expected_bad.append((i, reason, line.decode("utf-8", errors="backslashreplace")))
    assert table.to_pylist() == expected_rows
    assert [(r["line"], r["reason"], r["raw"]) for r in records] == expected_bad


def test_quick_split_and_line_scan_agree(tmp_path, monkeypatch):
    rows = ['a,1,1.5,2,ff,"x,y",1|2,2026110314', "b,0,,,,,,2026110314", 'c,1,2,3,zz,s,,2026110314',
            'd,"1,2', "e,1", "", "f,yes,1,1,1,é,3,2026110314", "g,1,1,1,1,s,,2026110314\r"]
    path = tmp_path / "c.csv"
    path.write_text("\n".join(rows * 3) + "\n")
    normal = read_all(path, ANY, tmp_path / "a.jsonl", batch_rows=4)
    monkeypatch.setattr(text_mod.TextBlockParser, "_quick", lambda self, block, n: None)
    scanned = read_all(path, ANY, tmp_path / "b.jsonl", batch_rows=4)
    assert normal[0].equals(scanned[0]) and normal[1] == scanned[1]
    assert normal[0].num_rows == 4 * 3
    assert [r["reason"] for r in normal[1][:4]] == [
        "column 'h': invalid hex: 'zz'", "unterminated quote '\"'", "wrong field count: expected 8, got 2",
        "wrong field count: expected 8, got 1"]
    assert json.loads((tmp_path / "a.jsonl").read_text().splitlines()[0])["line"] == 3
