"""Reader for Parquet day files of any schema (a warehouse export): columns by name, one row group at a time.

Before any row is read the file's schema is checked against the dataset: a missing column, a column the
dataset does not declare (declare it with role `ignore`) or a column of the wrong type is a DataError naming the
column (and both types). Accepted types per role:

- label: integer, boolean (true = positive) or string, mapped through the label's positive/negative values;
- dense: integer, or floating for dtype float;
- categorical / multi_hot elements: string for every encoding (parsed as the text reader parses it), or integer
  for hex32/hex64/int (taken as the id); multi_hot must be a list;
- timestamp: a timestamp or date (no zone = UTC), a string parsed by the format, or an integer for unix/unix_ms.

Row-level problems (a label value neither positive nor negative, a null label or timestamp, a string that does
not parse in its encoding or format) quarantine the row with its 1-based record index in the file and the row
as JSON (its stored columns). A corrupt or truncated file is a DataError naming the file and the row group when known.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recforge.config import DatasetConfig
from recforge.config.datasets import DenseFeature, LabelColumn, MultiHotFeature, SparseFeature, TimestampColumn
from recforge.data import encodings as enc
from recforge.data.errors import DataError
from recforge.data.quarantine import Quarantine
from recforge.data.reader_text import convert_string_columns
from recforge.data.schema import TIMESTAMP_TYPE, arrow_schema, stored_columns

_READ_ERRORS = (OSError, pa.ArrowException, ValueError)


def _is_str(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) or \
        pa.types.is_list_view(t)


def _type_ok(spec: Any, t: pa.DataType) -> str | None:
    """None if column type `t` is accepted for `spec`, else what the role needs."""
    if isinstance(spec, LabelColumn):
        ok = pa.types.is_integer(t) or pa.types.is_boolean(t) or _is_str(t)
        return None if ok else "an integer, boolean or string label"
    if isinstance(spec, DenseFeature):
        ok = pa.types.is_integer(t) or (spec.dtype == "float" and pa.types.is_floating(t))
        return None if ok else ("an integer or floating column" if spec.dtype == "float" else "an integer column")
    if isinstance(spec, MultiHotFeature):
        if not _is_list(t):
            return "a list column"
        inner = _type_ok(SparseFeature(name=spec.name, encoding=spec.encoding), t.value_type)
        return None if inner is None else f"a list of {inner.removeprefix('a ')}"
    if isinstance(spec, SparseFeature):
        ok = _is_str(t) or (spec.encoding != "string" and pa.types.is_integer(t))
        return None if ok else ("a string column" if spec.encoding == "string" else "a string or integer column")
    if isinstance(spec, TimestampColumn):
        ok = pa.types.is_timestamp(t) or pa.types.is_date(t) or _is_str(t) or \
            (spec.format in ("unix", "unix_ms") and pa.types.is_integer(t))
        return None if ok else "a timestamp, date or string column"
    return None


def check_parquet_schema(schema: pa.Schema, dataset: DatasetConfig, path: Path) -> None:
    names = schema.names
    want = dataset.field_names
    missing = [n for n in want if n not in names]
    extra = [n for n in names if n not in want]
    if missing or extra:
        parts = ([f"missing columns {missing}"] if missing else []) + (
            [f"extra columns {extra} (declare them with role ignore)"] if extra else [])
        reason = "columns do not match the schema: " + ", ".join(parts)
        raise DataError(f"{path}: {reason}", path=path, column=(missing or extra)[0], reason=reason)
    for spec in dataset.columns:
        t = schema.field(spec.name).type
        need = _type_ok(spec, t)
        if need is not None:
            reason = f"column {spec.name!r} is {t}, the schema's {spec.role} column needs {need}"
            raise DataError(f"{path}: {reason}", path=path, column=spec.name, reason=reason)


def _label(spec: LabelColumn, col: pa.Array) -> tuple[pa.Array, np.ndarray]:
    if pa.types.is_boolean(col.type):
        valid = np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
        vals = np.asarray(pc.fill_null(col, False).to_numpy(zero_copy_only=False), dtype=np.int8)
        return pa.array(vals, type=pa.int8()), ~valid
    text = col if _is_str(col.type) else pc.cast(col, pa.string())
    pos = np.asarray(pc.fill_null(pc.is_in(text, value_set=pa.array(spec.positive)), False)
                     .to_numpy(zero_copy_only=False), dtype=bool)
    neg = np.asarray(pc.fill_null(pc.is_in(text, value_set=pa.array(spec.negative)), False)
                     .to_numpy(zero_copy_only=False), dtype=bool)
    return pa.array(pos.astype(np.int8), type=pa.int8()), ~(pos | neg)


def _int_ids(col: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """Integer ids as int64; uint64 values above int64 keep their 64 bits (as hex64 does)."""
    if pa.types.is_uint64(col.type):
        vals = pc.fill_null(col, 0).to_numpy(zero_copy_only=False).view(np.int64)
        return pa.array(vals, type=pa.int64(), mask=np.asarray(pc.is_null(col).to_numpy(
            zero_copy_only=False), dtype=bool)), np.zeros(len(col), dtype=bool)
    return pc.cast(col, pa.int64()), np.zeros(len(col), dtype=bool)


def _typed(spec: Any, col: pa.Array, ts_cache: dict[str, int | None]) -> tuple[pa.Array, np.ndarray]:
    """A non-string column (or a list column) -> stored type and bad mask."""
    if isinstance(spec, LabelColumn):
        return _label(spec, col)
    if isinstance(spec, DenseFeature):
        return pc.cast(col, pa.float64() if spec.dtype == "float" else pa.int64()), np.zeros(len(col), bool)
    if isinstance(spec, MultiHotFeature):
        lists = col.cast(pa.list_(col.type.value_type)) if not pa.types.is_list(col.type) else col
        n = len(lists)
        lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        elems = pc.list_flatten(lists)  # null lists contribute no elements
        if _is_str(elems.type):
            ids, elem_bad = enc.vec_ids(elems, spec.encoding)
            elem_bad = elem_bad | np.asarray(pc.fill_null(pc.equal(pc.utf8_length(elems), 0), True)
                                             .to_numpy(zero_copy_only=False), dtype=bool)
        else:
            ids, elem_bad = _int_ids(elems)
            elem_bad = elem_bad | np.asarray(pc.is_null(elems).to_numpy(zero_copy_only=False), dtype=bool)
        bad = np.zeros(n, dtype=bool)
        if elem_bad.any():
            bad[np.repeat(np.arange(n), lengths)[elem_bad]] = True
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        return pa.ListArray.from_arrays(pa.array(offsets), pc.fill_null(ids, 0),
                                        type=pa.list_(pa.int64())), bad
    if isinstance(spec, SparseFeature):
        return _int_ids(col)
    if isinstance(spec, TimestampColumn):
        if pa.types.is_integer(col.type):
            secs = pc.cast(col, pa.int64())
            if spec.format == "unix_ms":
                ms = pc.fill_null(secs, 0).to_numpy(zero_copy_only=False)
                secs = pa.array(np.floor_divide(ms, 1000), mask=np.asarray(pc.is_null(col).to_numpy(
                    zero_copy_only=False), dtype=bool))
            values = pc.cast(secs, TIMESTAMP_TYPE)
        elif pa.types.is_date(col.type):
            values = pc.cast(pc.cast(col, pa.timestamp("s")), TIMESTAMP_TYPE)
        else:
            values = _floor_seconds(col)
        return values, np.asarray(pc.is_null(values).to_numpy(zero_copy_only=False), dtype=bool)
    raise TypeError(f"no conversion for column role {spec.role!r}")


def _floor_seconds(col: pa.Array) -> pa.Array:
    """Any timestamp -> timestamp[s, UTC], floored to the second (no zone = UTC)."""
    unit = col.type.unit
    per_s = {"s": 1, "ms": 1000, "us": 10**6, "ns": 10**9}[unit]
    raw = pc.cast(col, pa.int64()) if col.type.tz is None else pc.cast(col.cast(pa.timestamp(unit)), pa.int64())
    vals = pc.fill_null(raw, 0).to_numpy(zero_copy_only=False)
    null = np.asarray(pc.is_null(raw).to_numpy(zero_copy_only=False), dtype=bool)
    return pa.array(np.floor_divide(vals, per_s), type=pa.int64(), mask=null).cast(TIMESTAMP_TYPE)


def _reasons(row: dict[str, Any], dataset: DatasetConfig) -> str:
    """Why one record is bad (the reference for the quarantine's reason)."""
    reasons = []
    for spec in stored_columns(dataset):
        v = row[spec.name]
        name = spec.name
        if isinstance(spec, LabelColumn):
            if v is None:
                reasons.append(f"column {name!r}: label is null")
            elif not isinstance(v, bool) and str(v) not in spec.positive + spec.negative:
                reasons.append(f"column {name!r}: label value {str(v)!r} is neither positive {spec.positive} "
                               f"nor negative {spec.negative}")
        elif isinstance(spec, TimestampColumn):
            if v is None:
                reasons.append(f"column {name!r}: missing timestamp")
            elif isinstance(v, str):
                why = enc.ref_timestamp(v, spec.format)[1] if v else "missing timestamp"
                if why:
                    reasons.append(f"column {name!r}: {why}")
        elif isinstance(spec, MultiHotFeature):
            for k, e in enumerate(v or []):
                if e is None or e == "":
                    reasons.append(f"column {name!r}: element {k + 1} is empty")
                    break
                if isinstance(e, str):
                    why = enc.ref_id(e, spec.encoding)[1]
                    if why:
                        reasons.append(f"column {name!r}: element {k + 1} of {v!r}: {why}")
                        break
        elif isinstance(spec, SparseFeature) and isinstance(v, str) and v:
            why = enc.ref_id(v, spec.encoding)[1]
            if why:
                reasons.append(f"column {name!r}: {why}")
    return "; ".join(reasons) or "row rejected"


def read_parquet(
    path: Path,
    dataset: DatasetConfig,
    quarantine: Quarantine,
    batch_rows: int = 65536,
    *,
    on_progress: Callable[[int], None] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Valid rows of a Parquet file, read one row group at a time, in batches of at most `batch_rows`."""
    try:
        pf = pq.ParquetFile(path)
        file_schema = pf.schema_arrow
    except _READ_ERRORS as exc:
        raise DataError(f"{path}: not a readable Parquet file: {exc}", path=path) from exc
    check_parquet_schema(file_schema, dataset, path)
    specs = stored_columns(dataset)
    schema = arrow_schema(dataset)
    names = [c.name for c in specs]
    ts_cache: dict[str, int | None] = {}
    size = path.stat().st_size
    record = 0
    try:
        for g in range(pf.num_row_groups):
            try:
                table = pf.read_row_group(g, columns=names, use_threads=False)
            except _READ_ERRORS as exc:
                raise DataError(f"{path}: row group {g}: corrupt or unreadable Parquet data: {exc}", path=path,
                                row_group=g) from exc
            for batch in table.to_batches(max_chunksize=batch_rows):
                strings = {}
                arrays: dict[str, pa.Array] = {}
                bad = np.zeros(batch.num_rows, dtype=bool)
                for spec in specs:
                    col = batch.column(spec.name)
                    if _is_str(col.type) and not isinstance(spec, LabelColumn):
                        strings[spec.name] = col.cast(pa.string())
                    else:
                        arrays[spec.name], b = _typed(spec, col, ts_cache)
                        bad |= b
                if strings:
                    sub = [s for s in specs if s.name in strings]
                    conv, b = convert_string_columns(strings, sub, pa.schema([schema.field(s.name) for s in sub]),
                                                     ts_cache)
                    bad |= b
                    arrays.update({s.name: conv.column(s.name) for s in sub})
                out = pa.RecordBatch.from_arrays([arrays[n] for n in names], schema=schema)
                if bad.any():
                    for i in np.flatnonzero(bad):
                        row = batch.slice(int(i), 1).to_pylist()[0]
                        reason = _reasons(row, dataset)
                        quarantine.add(path, record + int(i) + 1, reason, json.dumps(row, default=str))
                    out = out.filter(pa.array(~bad))
                record += batch.num_rows
                if out.num_rows:
                    yield out
            if on_progress is not None:
                on_progress(int(size * (g + 1) / max(pf.num_row_groups, 1)))
    finally:
        pf.close()
