"""The op vocabulary of a preprocessing plan: each op's parameters, the values it takes and gives.

Values along a feature's chain have a type and a width:
  type  "raw"   the source column as stored in a shard: int64 with nulls (a RawBatch gives values + valid mask)
        "float" float32 values (a dense feature's final type)
        "id"    int64 ids (a sparse feature's final type)
  width values per row, for a scalar source column (1 after fill_null; onehot, firstx and ngram change it).
        A list (multi-hot) source column has a width per row; the same rules apply row by row at run time.
Every chain starts with fill_null, which turns a raw dense column into float and a raw sparse column into ids.
Each op also maps the range of ids it outputs, so a sparse feature's embedding table size follows from its ops
(sigrid_hash -> [0, M), bucketize -> [0, K], clamp -> [lo, hi], mapid -> [0, max(map)]).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

ValueType = Literal["raw", "float", "id"]
IdRange = tuple[int, int] | None  # [lo, hi) of the ids a chain can produce; None = unbounded / not ids


@dataclass(frozen=True)
class Value:
    """What flows between two ops of a chain (static): its type and how many values a row holds."""

    type: ValueType
    width: int


class OpError(ValueError):
    """An op cannot take its input (wrong value type or width) or its parameters do not fit."""


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _finite(name: str, v: float) -> float:
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite")
    return v


class FillNullParams(_Params):
    value: int | float = 0

    @field_validator("value")
    @classmethod
    def _finite(cls, v: float) -> float:
        return _finite("value", v) if isinstance(v, float) else v


class CastParams(_Params):
    to: Literal["float", "id"]


class LogitParams(_Params):
    eps: float = Field(1e-5, gt=0.0, lt=0.5)


class Log1pParams(_Params):
    pass


class BoxCoxParams(_Params):
    lmbda: float = Field(alias="lambda")

    @field_validator("lmbda")
    @classmethod
    def _finite(cls, v: float) -> float:
        return _finite("lambda", v)


class BucketizeParams(_Params):
    borders: list[float] = Field(min_length=1)

    @field_validator("borders")
    @classmethod
    def _increasing(cls, v: list[float]) -> list[float]:
        if not all(math.isfinite(b) for b in v):
            raise ValueError("borders must be finite")
        if any(a >= b for a, b in pairwise(v)):
            raise ValueError(f"borders must be strictly increasing, got {v}")
        return v


class ClampParams(_Params):
    lo: int | float
    hi: int | float

    @model_validator(mode="after")
    def _ordered(self) -> ClampParams:
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)) or self.lo > self.hi:
            raise ValueError(f"need finite lo <= hi, got lo={self.lo} hi={self.hi}")
        return self


class FirstXParams(_Params):
    X: int = Field(ge=1)


class SigridHashParams(_Params):
    salt: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    M: int = Field(ge=1, le=INT64_MAX)


class OneHotParams(_Params):
    lo: int | float
    hi: int | float
    C: int = Field(ge=1, le=1 << 16, description="number of classes: the output width")

    @model_validator(mode="after")
    def _ordered(self) -> OneHotParams:
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)) or not self.lo < self.hi:
            raise ValueError(f"need finite lo < hi, got lo={self.lo} hi={self.hi}")
        return self


class NGramParams(_Params):
    n: int = Field(ge=1, le=1 << 10)


class MapIdParams(_Params):
    map: list[int] = Field(min_length=1)

    @field_validator("map")
    @classmethod
    def _int64(cls, v: list[int]) -> list[int]:
        bad = [x for x in v if not INT64_MIN <= x <= INT64_MAX]
        if bad:
            raise ValueError(f"map values must fit int64, got {bad[:3]}")
        return v


def _is_id(v: float) -> bool:
    """An integral value that fits int64 (ints, or floats such as 0.0 that hold one)."""
    return (isinstance(v, int) or (isinstance(v, float) and v.is_integer())) and INT64_MIN <= v <= INT64_MAX


def _expect(got: ValueType, *allowed: ValueType) -> None:
    if got not in allowed:
        hint = "; start the chain with fill_null" if got == "raw" else ""
        raise OpError(f"takes {' or '.join(allowed)} values, got {got}{hint}")


def _fill_null_out(p: FillNullParams, v: Value, src: str) -> Value:
    _expect(v.type, "raw")
    if src == "dense":
        return Value("float", 1)
    if not _is_id(p.value) or abs(p.value) > 2**53:
        raise OpError(f"fill value for a sparse (id) column must be an integer within +-2**53 (kernels pass fill "
                      f"values as float64), got {p.value}")
    return Value("id", 1)


def _cast_out(p: CastParams, v: Value, src: str) -> Value:
    _expect(v.type, "float", "id")
    return Value(p.to, v.width)


def _float_to_float(p: Any, v: Value, src: str) -> Value:
    _expect(v.type, "float")
    return v


def _bucketize_out(p: BucketizeParams, v: Value, src: str) -> Value:
    _expect(v.type, "float")
    return Value("id", v.width)


def _clamp_out(p: ClampParams, v: Value, src: str) -> Value:
    _expect(v.type, "float", "id")
    if v.type == "id" and not (_is_id(p.lo) and _is_id(p.hi)):
        raise OpError(f"bounds for ids must be int64 integers, got lo={p.lo} hi={p.hi}")
    return v


def _firstx_out(p: FirstXParams, v: Value, src: str) -> Value:
    _expect(v.type, "float", "id")
    return Value(v.type, min(p.X, v.width))


def _ids_out(p: Any, v: Value, src: str) -> Value:
    _expect(v.type, "id")
    return v


def _onehot_out(p: OneHotParams, v: Value, src: str) -> Value:
    _expect(v.type, "float", "id")
    if v.width != 1:
        raise OpError(f"takes one value per row, got {v.width} (put firstx(1) before it)")
    return Value("float", p.C)


def ngram_width(n: int, w: int) -> int:
    """Values a row of w values holds after ngram(n): every window of n' = min(n, w) values, concatenated."""
    k = min(n, w)
    return (w - k + 1) * k


def _ngram_out(p: NGramParams, v: Value, src: str) -> Value:
    _expect(v.type, "float", "id")
    return Value(v.type, ngram_width(p.n, v.width))


def _no_ids(p: Any, rng: IdRange) -> IdRange:
    return None


def _same_ids(p: Any, rng: IdRange) -> IdRange:
    return rng


def _clamp_ids(p: ClampParams, rng: IdRange) -> IdRange:
    if not (_is_id(p.lo) and _is_id(p.hi)):
        return rng  # a float clamp; on ids it is a type error that validate_for reports
    lo, hi = int(p.lo), int(p.hi)
    if rng is not None:  # clamp is monotone: the input range [a, b) maps onto [clamp(a), clamp(b - 1)]
        a, b = rng
        lo, hi = min(max(a, lo), hi), max(min(b - 1, hi), lo)
    return lo, hi + 1


def _mapid_ids(p: MapIdParams, rng: IdRange) -> IdRange:
    return min(0, min(p.map)), max(0, max(p.map)) + 1  # ids outside the map give 0


def _cast_ids(p: CastParams, rng: IdRange) -> IdRange:
    return rng if p.to == "id" else None


@dataclass(frozen=True)
class OpDef:
    name: str
    params: type[_Params]
    out: Callable[[Any, Value, str], Value]  # (params, input value, source column kind) -> output; OpError
    out_ids: Callable[[Any, IdRange], IdRange]  # (params, input id range) -> output id range
    elementwise: bool  # each output value depends on one input value (so jagged rows keep their lengths)
    doc: str

    def out_type(self, p: Any, t: ValueType, src: str) -> ValueType:
        """The output type for a width-1 input (kept for callers that only track types)."""
        return self.out(p, Value(t, 1), src).type


OPS: dict[str, OpDef] = {
    d.name: d
    for d in [
        OpDef("fill_null", FillNullParams, _fill_null_out, _no_ids, True,
              "null -> value; dense -> float32, sparse -> int64 (in a list column: null elements; a null list "
              "is an empty list)"),
        OpDef("cast", CastParams, _cast_out, _cast_ids, True,
              "to float32 (round to nearest) or to int64 (truncate; NaN -> 0; beyond int64 saturates)"),
        OpDef("logit", LogitParams, _float_to_float, _no_ids, True,
              "t = clamp(x, eps, 1-eps) (float32); ln(t / (1-t)) in float64, rounded to float32"),
        OpDef("log1p", Log1pParams, _float_to_float, _no_ids, True,
              "log1p(max(x, 0)) in float64, rounded to float32 (counts: negatives clamp to 0, as TorchRec's DLRM "
              "example does); NaN stays NaN, +inf stays +inf"),
        OpDef("boxcox", BoxCoxParams, _float_to_float, _no_ids, True,
              "x > 0: ln x (lambda 0) or (x^lambda - 1)/lambda in float64, rounded to float32; x <= 0 and NaN "
              "unchanged"),
        OpDef("bucketize", BucketizeParams, _bucketize_out, lambda p, r: (0, len(p.borders) + 1), True,
              "#{i: x > borders[i]} (float32 compare; NaN -> 0)"),
        OpDef("clamp", ClampParams, _clamp_out, _clamp_ids, True, "min(max(x, lo), hi); NaN stays NaN"),
        OpDef("firstx", FirstXParams, _firstx_out, _same_ids, False, "keep the first X values of each row"),
        OpDef("sigrid_hash", SigridHashParams, _ids_out, lambda p, r: (0, p.M), True,
              "TorchArrow sigrid_hash(salt) floor-mod M"),
        OpDef("onehot", OneHotParams, _onehot_out, _no_ids, False,
              "C floats, 1 at i = trunc((x - lo) / ((hi - lo) / C)) in float32, 0 elsewhere; i = 0 when it falls "
              "outside [0, C) (NaN, +-inf included)"),
        OpDef("ngram", NGramParams, _ngram_out, _same_ids, False,
              "all windows of n' = min(n, w) consecutive values, concatenated: (w - n' + 1) * n' values"),
        OpDef("mapid", MapIdParams, _ids_out, _mapid_ids, True, "map[x] for 0 <= x < len(map), else 0"),
    ]
}


def parse_params(op: str, params: dict[str, Any]) -> _Params:
    """Validate one op's parameters; OpError names the op's problem (unknown op, missing/unknown/wrong parameter)."""
    if op not in OPS:
        raise OpError(f"unknown op {op!r}; known ops: {sorted(OPS)}")
    try:
        return OPS[op].params.model_validate(params)
    except ValidationError as e:
        raise OpError("; ".join(_describe(err) for err in e.errors())) from None


def _describe(err: ErrorDetails) -> str:
    name = ".".join(str(p) for p in err["loc"]) or "params"
    if err["type"] == "missing":
        return f"missing parameter {name!r}"
    if err["type"] == "extra_forbidden":
        return f"unknown parameter {name!r}"
    return f"parameter {name!r}: {err['msg']} (got {err.get('input')!r})"
