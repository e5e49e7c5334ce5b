"""Column encodings of raw files: text -> typed values, vectorized per block and as a per-value reference.

Each `vec_*` function takes a pyarrow string array (null or "" = missing) and returns the typed array plus a
numpy mask of the entries that do not parse; the matching `ref_*` function parses one str and returns
(value, None) or (None, reason). The readers use the vectorized form and ask the reference for the reason of
each rejected row; the tests check both agree. Grammars:

- int (dense int, categorical `int`, timestamp `unix`/`unix_ms`): -?[0-9]+ within int64.
- float (dense float): [+-]?(digits[.digits] | .digits)([eE][+-]?digits)?, finite (no nan/inf).
- hex32 / hex64: 1-8 / 1-16 hex digits, either case; hex64 keeps the 64 bits as a signed int64.
- string: any non-empty text; the id is xxh3_64 (seed 0) of its UTF-8 bytes as a signed int64 (`string_id`,
  docs/data.md "String ids"). Each distinct value of a block is hashed once.
- timestamp: `unix` (seconds), `unix_ms` (milliseconds, floored to seconds) or a strptime format (times
  without a zone are UTC; parsed once per distinct value with Python's strptime, cached).
"""
from __future__ import annotations

import calendar
import math
import re
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
HEX_DIGITS = {"hex32": 8, "hex64": 16}

_INT_RE = re.compile(r"-?[0-9]+", re.ASCII)
_HEX_RE = re.compile(r"[0-9a-fA-F]+", re.ASCII)
_FLOAT_PATTERN = r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"
_FLOAT_RE = re.compile(_FLOAT_PATTERN, re.ASCII)

# byte -> nibble value, 255 for a byte that is not a hex digit
_HEX_LUT = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_LUT[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_LUT[_c] = 10 + _i
# two bytes (as little-endian uint16: first char in the low byte) -> their byte value, 0xFFFF if invalid
HEX_PAIR_LUT = np.full(1 << 16, 0xFFFF, dtype=np.uint16)
_valid = np.flatnonzero(_HEX_LUT != 255)
HEX_PAIR_LUT[(_valid[:, None] | (_valid[None, :] << 8)).ravel()] = (
    _HEX_LUT[_valid][:, None].astype(np.uint16) * 16 + _HEX_LUT[_valid][None, :]
).ravel()
# bytes allowed anywhere in a decimal integer field ("-" position is checked by the cast)
_DEC_OK = np.zeros(256, dtype=bool)
_DEC_OK[list(b"0123456789-")] = True
_FLOAT_OK = np.zeros(256, dtype=bool)
_FLOAT_OK[list(b"0123456789-+.eE")] = True


# ---------------------------------------------------------------------------------------------- per-value reference


def ref_int(s: str) -> tuple[int | None, str | None]:
    if not _INT_RE.fullmatch(s):
        return None, f"not an integer: {s!r}"
    v = int(s)
    if not INT64_MIN <= v <= INT64_MAX:
        return None, f"integer out of int64 range: {s!r}"
    return v, None


def ref_float(s: str) -> tuple[float | None, str | None]:
    if not _FLOAT_RE.fullmatch(s):
        return None, f"not a number: {s!r}"
    v = float(s)
    if not math.isfinite(v):
        return None, f"not a finite number: {s!r}"
    return v, None


def ref_hex(s: str, digits: int) -> tuple[int | None, str | None]:
    if not _HEX_RE.fullmatch(s):
        return None, f"invalid hex: {s!r}"
    if len(s) > digits:
        return None, f"hex longer than {digits} digits: {s!r}"
    v = int(s, 16)
    return (v - (1 << 64) if v > INT64_MAX else v), None


def string_id(s: str | bytes) -> int:
    """The id of a string categorical value: xxh3_64 (seed 0) of its UTF-8 bytes, as a signed int64."""
    v = xxhash.xxh3_64_intdigest(s.encode("utf-8") if isinstance(s, str) else s)
    return v - (1 << 64) if v > INT64_MAX else v


def ref_id(s: str, encoding: str) -> tuple[int | None, str | None]:
    """A categorical value (non-empty) by encoding: hex32, hex64, int or string."""
    if encoding in HEX_DIGITS:
        return ref_hex(s, HEX_DIGITS[encoding])
    if encoding == "int":
        return ref_int(s)
    return string_id(s), None


def ref_timestamp(s: str, fmt: str) -> tuple[int | None, str | None]:
    """Seconds since the epoch (UTC) of a non-empty timestamp text."""
    if fmt in ("unix", "unix_ms"):
        v, why = ref_int(s)
        if v is None:
            return None, f"timestamp {s!r} is not {fmt} ({why})"
        return (v // 1000 if fmt == "unix_ms" else v), None
    try:
        dt = datetime.strptime(s, fmt)
    except ValueError:
        return None, f"timestamp {s!r} does not match format {fmt!r}"
    return calendar.timegm(dt.utctimetuple()), None


# ---------------------------------------------------------------------------------------------- vectorized


def string_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, starts, ends) of a pyarrow string array; null entries have start == end."""
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    data_buf = arr.buffers()[2]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return data, offsets[:-1], offsets[1:]


def vec_hex(arr: pa.Array, digits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (values int64, null mask, bad mask). Empty/null entries are null, not bad. digits: 8 or 16."""
    data, starts, ends = string_parts(arr)
    lens = ends - starts
    null = lens == 0
    n = len(arr)
    values = np.zeros(n, dtype=np.int64)
    bad = np.zeros(n, dtype=bool)
    present = ~null
    m = n - int(null.sum())
    if m == 0:
        return values, null, bad
    if int(ends[-1] - starts[0]) == digits * m and lens.max() == digits:
        # every present value has exactly `digits` digits: the column's data is a dense [m, digits] byte matrix
        chars = data[starts[0] : ends[-1]]
    else:  # right-align each value in `digits` bytes, padded with "0" (which is a valid digit)
        bad |= lens > digits
        idx = ends[present][:, None] - digits + np.arange(digits)
        inside = idx >= starts[present][:, None]
        chars = np.where(inside, data[np.maximum(idx, 0)], np.uint8(48)).astype(np.uint8)
    pairs = HEX_PAIR_LUT[np.ascontiguousarray(chars).view("<u2")].reshape(m, digits // 2)
    if pairs.max() > 255:
        bad[present] |= (pairs > 255).any(axis=1)
    big_endian = ">u4" if digits == 8 else ">u8"
    values[present] = pairs.astype(np.uint8).view(big_endian).ravel().astype(np.int64)  # hex64: wraps to signed
    values[bad] = 0
    return values, null, bad


def vec_int(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """-> (int64 array, nulls where missing or bad; bad mask). Grammar: -?[0-9]+ within int64."""
    data, starts, ends = string_parts(arr)
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


def vec_float(arr: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """-> (float64 array, nulls where missing or bad; bad mask). Grammar: see the module docstring."""
    data, starts, ends = string_parts(arr)
    n = len(arr)
    out = None
    if data.size == 0 or _FLOAT_OK[data[starts[0] : ends[-1]]].all():
        try:  # within these bytes arrow's cast accepts exactly the grammar
            out = pc.cast(arr, pa.float64())
            bad = np.zeros(n, dtype=bool)
        except pa.ArrowInvalid:
            out = None
    if out is None:
        ok = pc.fill_null(pc.match_substring_regex(arr, f"^{_FLOAT_PATTERN}$"), True).to_numpy(zero_copy_only=False)
        bad = ~np.asarray(ok, dtype=bool)
        out = pc.cast(pc.if_else(pa.array(bad), pa.scalar(None, pa.string()), arr), pa.float64())
    vals = out.to_numpy(zero_copy_only=False)
    infinite = np.isinf(vals)  # nulls come out as nan: isinf ignores them
    if infinite.any():
        bad = bad | infinite
        out = pc.if_else(pa.array(bad), pa.scalar(None, pa.float64()), out)
    return out, bad


def vec_string_ids(arr: pa.Array) -> pa.Array:
    """int64 ids (string_id) of a string array, each distinct value hashed once; null/"" -> null."""
    if len(arr) == 0:
        return pa.array([], type=pa.int64())
    enc = pc.dictionary_encode(arr)
    dictionary = enc.dictionary
    h = xxhash.xxh3_64_intdigest
    hashes = np.fromiter((h(s) for s in dictionary.cast(pa.binary()).to_pylist()), dtype=np.uint64,
                         count=len(dictionary)).view(np.int64)
    if len(dictionary) and not pc.all(pc.greater(pc.binary_length(dictionary), 0)).as_py():
        empties = np.asarray(pc.equal(pc.binary_length(dictionary), 0).to_numpy(zero_copy_only=False), dtype=bool)
    else:
        empties = None
    indices = enc.indices
    idx = pc.fill_null(indices, 0).to_numpy(zero_copy_only=False)
    values = hashes[idx] if len(hashes) else np.zeros(len(arr), dtype=np.int64)
    null = np.asarray(pc.is_null(indices).to_numpy(zero_copy_only=False), dtype=bool)
    if empties is not None:
        null |= empties[idx]
    return pa.array(values, type=pa.int64(), mask=null if null.any() else None)


def vec_ids(arr: pa.Array, encoding: str) -> tuple[pa.Array, np.ndarray]:
    """Categorical ids (int64, null where missing) and the bad mask, by encoding."""
    if encoding in HEX_DIGITS:
        values, null, bad = vec_hex(arr, HEX_DIGITS[encoding])
        return pa.array(values, type=pa.int64(), mask=null | bad), bad
    if encoding == "int":
        return vec_int(arr)
    return vec_string_ids(arr), np.zeros(len(arr), dtype=bool)


def vec_timestamp(arr: pa.Array, fmt: str, cache: dict[str, int | None]) -> tuple[pa.Array, np.ndarray]:
    """timestamp[s, UTC] values and the bad mask; `cache` maps text -> seconds (None: unparsable) across blocks."""
    ts_type = pa.timestamp("s", tz="UTC")
    if fmt in ("unix", "unix_ms"):
        secs, bad = vec_int(arr)
        if fmt == "unix_ms":
            valid = np.asarray(pc.is_valid(secs).to_numpy(zero_copy_only=False), dtype=bool)
            ms = pc.fill_null(secs, 0).to_numpy(zero_copy_only=False).astype(np.int64)
            secs = pa.array(np.floor_divide(ms, 1000), type=pa.int64(), mask=~valid)
        return pc.cast(secs, ts_type), bad
    enc = pc.dictionary_encode(arr)
    texts = enc.dictionary.to_pylist()
    secs_by_code = np.zeros(len(texts), dtype=np.int64)
    bad_by_code = np.zeros(len(texts), dtype=bool)
    for k, s in enumerate(texts):
        if s not in cache:
            cache[s] = ref_timestamp(s, fmt)[0] if s else None
        v = cache[s]
        if v is None:
            bad_by_code[k] = s != ""
        else:
            secs_by_code[k] = v
    null = np.asarray(pc.is_null(enc.indices).to_numpy(zero_copy_only=False), dtype=bool)
    idx = pc.fill_null(enc.indices, 0).to_numpy(zero_copy_only=False)
    if len(texts):
        values, bad = secs_by_code[idx], bad_by_code[idx] & ~null
        empty = np.asarray([s == "" for s in texts], dtype=bool)[idx]
        null |= empty | bad
    else:
        values, bad = np.zeros(len(arr), dtype=np.int64), np.zeros(len(arr), dtype=bool)
    return pa.array(values, type=pa.int64(), mask=null).cast(ts_type), bad


def vec_multi_hot(arr: pa.Array, encoding: str, delimiter: str) -> tuple[pa.Array, np.ndarray]:
    """list<int64> (missing field = empty list, never null) and the bad mask (any element bad or empty)."""
    n = len(arr)
    filled = pc.fill_null(arr, "")
    parts = pc.split_pattern(filled, delimiter)
    lengths = pc.list_value_length(parts).to_numpy(zero_copy_only=False).astype(np.int64)
    elems = pc.list_flatten(parts)
    is_empty_field = np.asarray(pc.equal(filled, "").to_numpy(zero_copy_only=False), dtype=bool)
    lengths[is_empty_field] = 0  # "" splits into [""]: an empty field is an empty list
    if is_empty_field.any():
        keep = np.repeat(~is_empty_field, np.asarray(pc.list_value_length(parts).to_numpy(zero_copy_only=False)))
        elems = elems.filter(pa.array(keep))
    row_of = np.repeat(np.arange(n), lengths)
    bad = np.zeros(n, dtype=bool)
    elem_empty = np.asarray(pc.equal(pc.utf8_length(elems), 0).to_numpy(zero_copy_only=False), dtype=bool)
    ids, elem_bad = vec_ids(elems, encoding)
    elem_bad = elem_bad | elem_empty
    if elem_bad.any():
        bad[row_of[elem_bad]] = True
        ids = pc.fill_null(ids, 0)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = pc.fill_null(ids, 0) if ids.null_count else ids
    return pa.ListArray.from_arrays(pa.array(offsets), values, type=pa.list_(pa.int64())), bad


def ref_multi_hot(s: str, encoding: str, delimiter: str) -> tuple[list[int] | None, str | None]:
    if s == "":
        return [], None
    out: list[int] = []
    for k, part in enumerate(s.split(delimiter)):
        if part == "":
            return None, f"empty element {k + 1} in {s!r}"
        v, why = ref_id(part, encoding)
        if v is None:
            return None, f"element {k + 1} of {s!r}: {why}"
        out.append(v)
    return out, None
