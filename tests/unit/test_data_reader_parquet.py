"""recforge.data.reader_parquet: typed columns by name, a multi-hot list column, row-level quarantine, schema and
corruption errors naming the column or the file."""
from __future__ import annotations

import json
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recforge.config import DatasetConfig
from recforge.data import DataError, Quarantine, ingest, read_source, string_id
from recforge.data.schema import arrow_schema

DS = DatasetConfig.model_validate({
    "name": "events", "format": "parquet",
    "columns": [
        {"name": "event_id", "role": "ignore"},
        {"name": "clicked", "role": "label", "positive": ["1"], "negative": ["0"]},
        {"name": "price", "role": "dense", "dtype": "float"},
        {"name": "visits", "role": "dense"},
        {"name": "item", "role": "categorical", "encoding": "string"},
        {"name": "shop", "role": "categorical", "encoding": "hex32"},
        {"name": "tags", "role": "multi_hot", "encoding": "string", "max_length": 4},
        {"name": "ts", "role": "timestamp", "format": "%Y-%m-%d %H:%M:%S"},
    ],
})
T0 = datetime(2026, 11, 3, 23, 59, 59, tzinfo=UTC)


def table(**override):
    cols = {
        "event_id": pa.array(["e1", "e2", "e3", "e4", "e5"]),
        "clicked": pa.array([1, 0, 2, None, 0], type=pa.int32()),
        "price": pa.array([1.5, None, 2.0, 3.0, 4.0]),
        "visits": pa.array([3, 4, None, 6, 7], type=pa.int16()),
        "item": pa.array(["apple", "pear", None, "fig", "kiwi"]),
        "shop": pa.array(["ff", "1a", "00", "zz", None]),
        "tags": pa.array([["a", "b"], [], None, ["c"], ["d", "e", "f"]], type=pa.list_(pa.string())),
        "ts": pa.array([T0, T0, T0, T0, datetime(2026, 11, 4, 0, 0, 1, tzinfo=UTC)], type=pa.timestamp("ms", "UTC")),
    }
    cols.update(override)
    return pa.table(cols)


def read_all(path, tmp_path, dataset=DS, batch_rows=65536):
    with Quarantine(tmp_path / "q.jsonl") as q:
        batches = list(read_source(path, dataset, q, batch_rows))
    return (pa.Table.from_batches(batches, schema=arrow_schema(dataset)),
            list(Quarantine.records(tmp_path / "q.jsonl")))


def test_parquet_with_multi_hot_list_and_row_level_quarantine(tmp_path):
    path = tmp_path / "day.parquet"
    pq.write_table(table(), path, row_group_size=2)
    got, records = read_all(path, tmp_path, batch_rows=1)
    assert got.to_pylist() == [
        {"clicked": 1, "price": 1.5, "visits": 3, "item": string_id("apple"), "shop": 0xFF,
         "tags": [string_id("a"), string_id("b")], "ts": T0},
        {"clicked": 0, "price": None, "visits": 4, "item": string_id("pear"), "shop": 0x1A, "tags": [], "ts": T0},
        {"clicked": 0, "price": 4.0, "visits": 7, "item": string_id("kiwi"), "shop": None,
         "tags": [string_id(t) for t in "def"], "ts": datetime(2026, 11, 4, 0, 0, 1, tzinfo=UTC)},
    ]
    assert [(r["line"], r["reason"]) for r in records] == [
        (3, "column 'clicked': label value '2' is neither positive ['1'] nor negative ['0']"),
        (4, "column 'clicked': label is null; column 'shop': invalid hex: 'zz'"),
    ]
    assert json.loads(records[1]["raw"])["item"] == "fig" and records[0]["file"] == str(path)


def test_string_timestamps_and_ingest_rows_by_day(tmp_path):
    path = tmp_path / "day.parquet"
    ts = pa.array(["2026-11-03 10:00:00", "2026-11-03 23:59:59", "yesterday", "2026-11-04 00:00:00", ""])
    pq.write_table(table(clicked=pa.array(["1", "0", "1", "0", "0"]), shop=pa.array([1, 2, 3, 4, 5]), ts=ts), path)
    got, records = read_all(path, tmp_path)
    assert got.column("shop").to_pylist() == [1, 2, 4]
    assert [(r["line"], r["reason"]) for r in records] == [
        (3, "column 'ts': timestamp 'yesterday' does not match format '%Y-%m-%d %H:%M:%S'"),
        (5, "column 'ts': missing timestamp"),
    ]
    m = ingest([path], DS, tmp_path / "out", rows_per_shard=10, max_bad_fraction=0.5)
    assert m.total_rows == 3 and m.rows_by_day == {"2026-11-03": 2, "2026-11-04": 1}
    with pytest.raises(DataError, match=r"day.parquet: 2 bad rows of 5 .*e.g. record 5: column 'ts'"):
        ingest([path], DS, tmp_path / "out2", rows_per_shard=10, max_bad_fraction=0.1)


@pytest.mark.parametrize(("override", "match"), [
    ({"visits": pa.array(["3", "4", "5", "6", "7"])},
     r"column 'visits' is string, the schema's dense column needs an integer column"),
    ({"tags": pa.array(["a", "b", "c", "d", "e"])},
     r"column 'tags' is string, the schema's multi_hot column needs a list column"),
    ({"item": pa.array([1, 2, 3, 4, 5])}, r"column 'item' is int64, the schema's categorical column needs a string"),
])
def test_wrong_column_type_names_the_column_and_both_types(tmp_path, override, match):
    path = tmp_path / "bad.parquet"
    pq.write_table(table(**override), path)
    with pytest.raises(DataError, match=match) as e:
        read_all(path, tmp_path)
    assert "bad.parquet" in str(e.value) and e.value.column in override


def test_missing_and_undeclared_columns(tmp_path):
    path = tmp_path / "cols.parquet"
    pq.write_table(table().drop_columns(["price"]).append_column("debug", pa.array([0] * 5)), path)
    with pytest.raises(DataError, match=r"cols.parquet: columns do not match the schema: missing columns "
                                        r"\['price'\], extra columns \['debug'\] \(declare them with role ignore\)"):
        read_all(path, tmp_path)


def test_corrupt_parquet_names_the_file(tmp_path):
    path = tmp_path / "cut.parquet"
    pq.write_table(table(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="cut.parquet: not a readable Parquet file"):
        read_all(path, tmp_path)
    # a footer that is intact but a row group's pages that are not
    pq.write_table(table(), path, row_group_size=2, compression="snappy")
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(2)  # price, a stored column
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start:start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"cut.parquet: row group 0: corrupt") as e:
        read_all(path, tmp_path)
    assert e.value.row_group == 0
