"""Column passes over ColumnPrograms (RECom §5, App. D).

* ``drop_implied_filters``: interval range analysis along the steps. Translation steps map ranges
  (bucketize -> [0, K] with K = len(boundaries), both ends included; floor-mod / hash -> [0, N); add
  shifts; a null-mask select adds its fill value); a clamp, Replace or Remove whose kept set contains the
  incoming range does nothing and is deleted (containment: lo >= l && hi <= r).
* ``merge_filters``: consecutive Removes keep the intersection; consecutive Replaces with one fill value
  likewise; overlapping consecutive clamps become one.
* ``fill_empty_rows``: "fill empty rows with a default id, pool, then zero the rows that were empty"
  is a pooled lookup whose empty rows are zero: the fill and the zeroing go; ``unique`` + inverse before
  a gather goes too (gathering the unique ids then expanding is gathering the ids).
* ``one_hot_to_gather``: a pool whose bags provably hold one id each is a plain gather.
Each pass returns the new program and what it did; ``optimize`` runs them to a fixed point.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from recforge.recom.columns.intervals import INT64_MAX, INT64_MIN, IntervalSet
from recforge.recom.columns.program import (
    AddConst,
    Bucketize,
    Clamp,
    ColumnProgram,
    Mod,
    Remove,
    Replace,
    Select,
    SigridHash,
    step_str,
)

_DTYPE_RANGES = {
    "int64": (INT64_MIN, INT64_MAX), "int32": (-(1 << 31), (1 << 31) - 1), "int16": (-(1 << 15), (1 << 15) - 1),
    "int8": (-128, 127), "uint8": (0, 255), "bool": (0, 1),
}


@dataclass
class PassLog:
    dropped: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)
    empty_rows: list[str] = field(default_factory=list)
    gathers: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {"filters_dropped": len(self.dropped), "filters_merged": len(self.merged),
                "empty_row_rewrites": len(self.empty_rows), "gathers": len(self.gathers)}


def input_range(p: ColumnProgram) -> IntervalSet | None:
    """Values the raw input may hold (None for floats: only a bucketize gives them a range)."""
    span = _DTYPE_RANGES.get(p.value.dtype)
    return IntervalSet.of(span) if span else None


def step_range(step, r: IntervalSet | None) -> IntervalSet | None:
    """The range after ``step`` given the range before it (None: not an integer range)."""
    if isinstance(step, Bucketize):
        return step.range
    if r is None:
        return None
    if isinstance(step, Mod):
        return r if IntervalSet.of((0, step.n - 1)).contains(r) else IntervalSet.of((0, step.n - 1))
    if isinstance(step, SigridHash):
        return IntervalSet.of((0, step.m - 1))
    if isinstance(step, Clamp):
        return r.clamp(step.lo, step.hi)
    if isinstance(step, AddConst):
        return r.shift(step.c)
    if isinstance(step, Replace):
        kept = r.intersect(step.keep)
        return kept.union(IntervalSet.point(step.value)) if not step.keep.contains(r) else kept
    if isinstance(step, Remove):
        return r.intersect(step.keep)
    if isinstance(step, Select):
        return r.union(IntervalSet.point(step.value))
    raise TypeError(f"unknown step {step!r}")


def implied(step, r: IntervalSet | None) -> bool:
    """The filter cannot change any value in range ``r``."""
    if r is None:
        return False
    if isinstance(step, Clamp):
        lo = INT64_MIN if step.lo is None else step.lo
        hi = INT64_MAX if step.hi is None else step.hi
        return lo <= hi and IntervalSet.of((lo, hi)).contains(r)
    if isinstance(step, (Replace, Remove)):
        return step.keep.contains(r)
    return False


def ids_range(p: ColumnProgram) -> IntervalSet | None:
    r = input_range(p)
    for s in p.steps:
        r = step_range(s, r)
    return r


def drop_implied_filters(p: ColumnProgram, log: PassLog) -> ColumnProgram:
    r = input_range(p)
    kept = []
    for s in p.steps:
        if implied(s, r):
            log.dropped.append(f"{p.name}: {step_str(s)} (ids already in {r})")
            continue
        kept.append(s)
        r = step_range(s, r)
    return p.with_(steps=tuple(kept)) if len(kept) != len(p.steps) else p


def _merge(a, b):
    if isinstance(a, Remove) and isinstance(b, Remove):
        return Remove(a.keep.intersect(b.keep))
    if isinstance(a, Replace) and isinstance(b, Replace) and a.value == b.value:
        return Replace(a.keep.intersect(b.keep), a.value)
    if isinstance(a, Clamp) and isinstance(b, Clamp):
        lo = max(v for v in (a.lo, b.lo, INT64_MIN) if v is not None)
        hi = min(v for v in (a.hi, b.hi, INT64_MAX) if v is not None)
        if lo <= hi and (a.lo is None or a.hi is None or a.lo <= a.hi) \
                and (b.lo is None or b.hi is None or b.lo <= b.hi):
            return Clamp(None if lo == INT64_MIN else lo, None if hi == INT64_MAX else hi)
    return None


def merge_filters(p: ColumnProgram, log: PassLog) -> ColumnProgram:
    out: list = []
    for s in p.steps:
        m = _merge(out[-1], s) if out else None
        if m is not None:
            log.merged.append(f"{p.name}: {step_str(out[-1])} + {step_str(s)} -> {step_str(m)}")
            out[-1] = m
        else:
            out.append(s)
    return p.with_(steps=tuple(out)) if len(out) != len(p.steps) else p


def fill_empty_rows(p: ColumnProgram, log: PassLog) -> ColumnProgram:
    changes: dict[str, Any] = {}
    if p.fill_empty is not None and p.zero_empty:
        changes.update(fill_empty=None, zero_empty=False)
        log.empty_rows.append(f"{p.name}: fill_empty({p.fill_empty}) + zero empty rows -> pooled lookup, "
                              "empty rows zero")
    elif p.zero_empty and p.fill_empty is None:
        changes.update(zero_empty=False)  # a pool already gives zeros for an empty row
        log.empty_rows.append(f"{p.name}: zeroing empty rows of a pool is a no-op")
    if p.unique:
        changes.update(unique=False)
        log.empty_rows.append(f"{p.name}: unique + gather + inverse -> gather")
    return p.with_(**changes) if changes else p


def one_hot_to_gather(p: ColumnProgram, log: PassLog) -> ColumnProgram:
    if p.lookup == "pool" and p.lengths is None and p.one_id_proof and p.fill_empty is None:
        log.gathers.append(f"{p.name}: {p.one_id_proof}")
        # sum or mean of one row is that row; a removed id leaves an empty bag: a zero row, as a gather
        # with a Remove step gives
        return p.with_(lookup="gather")
    return p


PASSES = (drop_implied_filters, merge_filters, fill_empty_rows, one_hot_to_gather)


def optimize(p: ColumnProgram, log: PassLog | None = None, max_rounds: int = 8) -> ColumnProgram:
    log = log if log is not None else PassLog()
    for _ in range(max_rounds):
        before = p
        for fn in PASSES:
            p = fn(p, log)
        if p == before:
            return p
    return p
