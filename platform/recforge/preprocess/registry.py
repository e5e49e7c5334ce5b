"""The op vocabulary of a preprocessing plan: each op's parameters, the value type it takes and gives.

Value types along a feature's chain:
  "raw"   the source column as stored in a shard: int64 with nulls (a RawBatch gives values + valid mask)
  "float" float32 values (a dense feature's final type)
  "id"    int64 ids (a sparse feature's final type)
Every chain starts with fill_null, which turns a raw dense column into float and a raw sparse column into ids.
Each op also maps the range of ids it outputs, so a sparse feature's embedding table size follows from its ops
(sigrid_hash -> [0, M), bucketize -> [0, K], clamp -> [lo, hi]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

ValueType = Literal["raw", "float", "id"]
IdRange = tuple[int, int] | None  # [lo, hi) of the ids a chain can produce; None = unbounded / not ids


class OpError(ValueError):
    """An op cannot take its input (wrong value type) or its parameters do not fit."""


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class FillNullParams(_Params):
    value: int | float = 0

    @field_validator("value")
    @classmethod
    def _finite(cls, v: float) -> float:
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("value must be finite")
        return v


class LogitParams(_Params):
    eps: float = Field(1e-5, gt=0.0, lt=0.5)


class BoxCoxParams(_Params):
    lmbda: float = Field(alias="lambda")

    @field_validator("lmbda")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("lambda must be finite")
        return v


class BucketizeParams(_Params):
    borders: list[float] = Field(min_length=1)

    @field_validator("borders")
    @classmethod
    def _increasing(cls, v: list[float]) -> list[float]:
        if not all(math.isfinite(b) for b in v):
            raise ValueError("borders must be finite")
        if any(a >= b for a, b in zip(v, v[1:])):
            raise ValueError(f"borders must be strictly increasing, got {v}")
        return v


class ClampParams(_Params):
    lo: int | float
    hi: int | float

    @model_validator(mode="after")
    def _ordered(self) -> "ClampParams":
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)) or self.lo > self.hi:
            raise ValueError(f"need finite lo <= hi, got lo={self.lo} hi={self.hi}")
        return self


class FirstXParams(_Params):
    X: int = Field(ge=1)


class SigridHashParams(_Params):
    salt: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    M: int = Field(ge=1, le=INT64_MAX)


def _is_id(v: float) -> bool:
    """An integral value that fits int64 (ints, or floats such as 0.0 that hold one)."""
    return (isinstance(v, int) or (isinstance(v, float) and v.is_integer())) and INT64_MIN <= v <= INT64_MAX


def _expect(got: ValueType, *allowed: ValueType) -> None:
    if got not in allowed:
        hint = "; start the chain with fill_null" if got == "raw" else ""
        raise OpError(f"takes {' or '.join(allowed)} values, got {got}{hint}")


def _fill_null_type(p: FillNullParams, t: ValueType, src: str) -> ValueType:
    _expect(t, "raw")
    if src == "dense":
        return "float"
    if not _is_id(p.value):
        raise OpError(f"fill value for a sparse (id) column must be an int64 integer, got {p.value}")
    return "id"


def _float_to_float(p: Any, t: ValueType, src: str) -> ValueType:
    _expect(t, "float")
    return "float"


def _bucketize_type(p: BucketizeParams, t: ValueType, src: str) -> ValueType:
    _expect(t, "float")
    return "id"


def _clamp_type(p: ClampParams, t: ValueType, src: str) -> ValueType:
    _expect(t, "float", "id")
    if t == "id" and not (_is_id(p.lo) and _is_id(p.hi)):
        raise OpError(f"bounds for ids must be int64 integers, got lo={p.lo} hi={p.hi}")
    return t


def _firstx_type(p: FirstXParams, t: ValueType, src: str) -> ValueType:
    _expect(t, "float", "id")
    return t


def _sigrid_hash_type(p: SigridHashParams, t: ValueType, src: str) -> ValueType:
    _expect(t, "id")
    return "id"


def _no_ids(p: Any, rng: IdRange) -> IdRange:
    return None


def _clamp_ids(p: ClampParams, rng: IdRange) -> IdRange:
    if not (_is_id(p.lo) and _is_id(p.hi)):
        return rng  # a float clamp; on ids it is a type error that validate_for reports
    lo, hi = int(p.lo), int(p.hi)
    if rng is not None:  # clamp is monotone: the input range [a, b) maps onto [clamp(a), clamp(b - 1)]
        a, b = rng
        lo, hi = min(max(a, lo), hi), max(min(b - 1, hi), lo)
    return lo, hi + 1


@dataclass(frozen=True)
class OpDef:
    name: str
    params: type[_Params]
    out_type: Callable[[Any, ValueType, str], ValueType]  # (params, input type, source column kind); OpError
    out_ids: Callable[[Any, IdRange], IdRange]  # (params, input id range) -> output id range
    doc: str


OPS: dict[str, OpDef] = {
    d.name: d
    for d in [
        OpDef("fill_null", FillNullParams, _fill_null_type, _no_ids,
              "null -> value; dense -> float32, sparse -> int64"),
        OpDef("logit", LogitParams, _float_to_float, _no_ids, "t = clamp(x, eps, 1-eps); ln(t / (1-t))"),
        OpDef("boxcox", BoxCoxParams, _float_to_float, _no_ids, "x > 0: ln x (lambda 0) or (x^lambda - 1)/lambda"),
        OpDef("bucketize", BucketizeParams, _bucketize_type, lambda p, r: (0, len(p.borders) + 1),
              "#{i: x > borders[i]} (float32 compare)"),
        OpDef("clamp", ClampParams, _clamp_type, _clamp_ids, "min(max(x, lo), hi)"),
        OpDef("firstx", FirstXParams, _firstx_type, lambda p, r: r, "keep the first X values of each row"),
        OpDef("sigrid_hash", SigridHashParams, _sigrid_hash_type, lambda p, r: (0, p.M),
              "TorchArrow sigrid_hash(salt) floor-mod M"),
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


def _describe(err: dict[str, Any]) -> str:
    name = ".".join(str(p) for p in err["loc"]) or "params"
    if err["type"] == "missing":
        return f"missing parameter {name!r}"
    if err["type"] == "extra_forbidden":
        return f"unknown parameter {name!r}"
    return f"parameter {name!r}: {err['msg']} (got {err.get('input')!r})"
