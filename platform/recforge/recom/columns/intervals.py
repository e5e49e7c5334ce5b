"""Sets of int64 values as sorted, disjoint, closed intervals: the domain of RECom's index-range analysis.

A filter is deleted when the set of values reaching it lies inside the set it keeps (``contains``: every
interval of one inside an interval of the other: lo >= l AND hi <= r; RECom's release tests ``||``), and
consecutive filters merge by intersecting what they keep.
"""
from __future__ import annotations

from dataclasses import dataclass

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class IntervalSet:
    spans: tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent, lo <= hi

    @staticmethod
    def of(*spans: tuple[int, int]) -> IntervalSet:
        clipped = sorted((max(lo, INT64_MIN), min(hi, INT64_MAX)) for lo, hi in spans)
        merged: list[list[int]] = []
        for lo, hi in clipped:
            if lo > hi:
                continue
            if merged and lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return IntervalSet(tuple((lo, hi) for lo, hi in merged))

    @staticmethod
    def full() -> IntervalSet:
        return IntervalSet(((INT64_MIN, INT64_MAX),))

    @staticmethod
    def empty() -> IntervalSet:
        return IntervalSet(())

    @staticmethod
    def point(v: int) -> IntervalSet:
        return IntervalSet.of((v, v))

    @staticmethod
    def compare(op: str, c: int) -> IntervalSet:
        """{x : x <op> c} for op in ge, gt, le, lt, eq, ne."""
        table = {
            "ge": ((c, INT64_MAX),), "gt": ((c + 1, INT64_MAX),), "le": ((INT64_MIN, c),),
            "lt": ((INT64_MIN, c - 1),), "eq": ((c, c),), "ne": ((INT64_MIN, c - 1), (c + 1, INT64_MAX)),
        }
        if op not in table:
            raise ValueError(f"unknown comparison {op!r}")
        return IntervalSet.of(*table[op])

    @property
    def is_empty(self) -> bool:
        return not self.spans

    @property
    def lo(self) -> int:
        return self.spans[0][0]

    @property
    def hi(self) -> int:
        return self.spans[-1][1]

    def __contains__(self, v: int) -> bool:
        return any(lo <= v <= hi for lo, hi in self.spans)

    def contains(self, other: IntervalSet) -> bool:
        """other is a subset of self: each of its intervals lies inside one of ours (&&, not ||)."""
        return all(any(lo >= left and hi <= right for left, right in self.spans) for lo, hi in other.spans)

    def intersect(self, other: IntervalSet) -> IntervalSet:
        out = []
        for a_lo, a_hi in self.spans:
            for b_lo, b_hi in other.spans:
                lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
                if lo <= hi:
                    out.append((lo, hi))
        return IntervalSet.of(*out)

    def union(self, other: IntervalSet) -> IntervalSet:
        return IntervalSet.of(*self.spans, *other.spans)

    def complement(self) -> IntervalSet:
        out, prev = [], INT64_MIN
        for lo, hi in self.spans:
            if lo > prev:
                out.append((prev, lo - 1))
            if hi == INT64_MAX:
                return IntervalSet.of(*out)
            prev = hi + 1
        out.append((prev, INT64_MAX))
        return IntervalSet.of(*out)

    def shift(self, c: int) -> IntervalSet:
        """{x + c} for x in self, saturating at the int64 ends (a wrap-around makes the set full)."""
        spans = []
        for lo, hi in self.spans:
            if lo + c < INT64_MIN or hi + c > INT64_MAX:
                return IntervalSet.full()
            spans.append((lo + c, hi + c))
        return IntervalSet.of(*spans)

    def clamp(self, lo: int | None, hi: int | None) -> IntervalSet:
        """{clamp(x, lo, hi)} for x in self (torch.clamp: min first, then max)."""
        out = []
        for a, b in self.spans:
            if lo is not None:
                a, b = max(a, lo), max(b, lo)
            if hi is not None:
                a, b = min(a, hi), min(b, hi)
            out.append((a, b))
        return IntervalSet.of(*out)

    def __str__(self) -> str:
        def fmt(v: int) -> str:
            return "-inf" if v == INT64_MIN else "+inf" if v == INT64_MAX else str(v)
        return " u ".join(f"[{fmt(lo)}, {fmt(hi)}]" for lo, hi in self.spans) or "{}"
