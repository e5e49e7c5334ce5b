"""Drift between two days' column statistics (recforge.data.stats): flags to report, never an error.

A run with drift goes on; the flags are logged as warnings, to MLflow and on the page. Design notes and the
defaults' reasoning: docs/data.md#column-statistics-and-drift.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from recforge.data.stats import ColumnStats, DatasetStats

DriftKind = Literal["rows", "appeared", "disappeared", "type", "missing_rate", "distinct", "mean_shift", "range",
                    "positive_rate"]


class DriftThresholds(BaseModel):
    """When a change between the previous day and this one is flagged."""

    model_config = ConfigDict(extra="forbid")

    missing_rate_abs: float = Field(0.1, ge=0, description="missing rate moved by more than this (absolute)")
    distinct_ratio: float = Field(2.0, gt=1, description="distinct count grew or shrank by more than this factor")
    distinct_min: int = Field(20, ge=0, description="distinct counts both below this are not compared")
    mean_shift_std: float = Field(0.5, ge=0, description="dense mean moved by more than this many of the "
                                  "previous day's standard deviations")
    range_ratio: float = Field(4.0, gt=1, description="dense max - min grew or shrank by more than this factor")
    positive_rate_rel: float = Field(0.25, ge=0, description="label positive rate moved by more than this share "
                                     "of the previous day's rate")
    rows_ratio: float = Field(3.0, gt=1, description="the day's row count grew or shrank by more than this factor")


class DriftFlag(BaseModel):
    """One change worth a look. `column` is None for a dataset-wide flag (the row count)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    column: str | None
    kind: DriftKind
    previous: float | str | None = None
    current: float | str | None = None
    threshold: float | None = None
    message: str = Field(description="one line for the task log and the page")


def _ratio(a: float, b: float) -> float:
    """How many times larger the larger of two non-negative numbers is (inf if one is 0 and the other not)."""
    lo, hi = min(a, b), max(a, b)
    if hi == 0:
        return 1.0
    return math.inf if lo == 0 else hi / lo


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"


def _column_flags(name: str, p: ColumnStats, c: ColumnStats, t: DriftThresholds) -> list[DriftFlag]:
    out: list[DriftFlag] = []

    def flag(kind: DriftKind, prev: float | str | None, cur: float | str | None, threshold: float | None,
             message: str) -> None:
        out.append(DriftFlag(column=name, kind=kind, previous=prev, current=cur, threshold=threshold,
                             message=f"column {name!r}: {message}"))

    if p.arrow_type != c.arrow_type:
        flag("type", p.arrow_type, c.arrow_type, None, f"type changed from {p.arrow_type} to {c.arrow_type}")
    if abs(c.missing_rate - p.missing_rate) > t.missing_rate_abs:
        flag("missing_rate", p.missing_rate, c.missing_rate, t.missing_rate_abs,
             f"missing rate {p.missing_rate:.1%} -> {c.missing_rate:.1%} (moved more than {t.missing_rate_abs:.0%})")
    if max(p.distinct, c.distinct) >= t.distinct_min and _ratio(p.distinct, c.distinct) > t.distinct_ratio:
        flag("distinct", p.distinct, c.distinct, t.distinct_ratio,
             f"distinct values {p.distinct:,} -> {c.distinct:,} (changed more than {t.distinct_ratio:g}x)")
    pm, cm, ps = p.mean, c.mean, p.std
    if c.role == "dense" and pm is not None and cm is not None and ps is not None:
        shift = abs(cm - pm)
        if (shift > t.mean_shift_std * ps) if ps > 0 else (shift > 0):
            sds = f"{shift / ps:.2f}" if ps > 0 else "inf"
            flag("mean_shift", pm, cm, t.mean_shift_std,
                 f"mean {_fmt(pm)} -> {_fmt(cm)}, a shift of {sds} previous standard deviations "
                 f"(over {t.mean_shift_std:g})")
    if c.role == "dense" and p.min is not None and p.max is not None and c.min is not None and c.max is not None:
        if _ratio(p.max - p.min, c.max - c.min) > t.range_ratio:
            flag("range", p.max - p.min, c.max - c.min, t.range_ratio,
                 f"range [{_fmt(p.min)}, {_fmt(p.max)}] -> [{_fmt(c.min)}, {_fmt(c.max)}] "
                 f"(width changed more than {t.range_ratio:g}x)")
    if c.role == "label" and p.positive_rate is not None and c.positive_rate is not None:
        moved = abs(c.positive_rate - p.positive_rate)
        if (moved > t.positive_rate_rel * p.positive_rate) if p.positive_rate > 0 else (moved > 0):
            flag("positive_rate", p.positive_rate, c.positive_rate, t.positive_rate_rel,
                 f"positive rate {p.positive_rate:.2%} -> {c.positive_rate:.2%} "
                 f"(moved more than {t.positive_rate_rel:.0%} of the previous rate)")
    return out


def compare_stats(previous: DatasetStats | None, current: DatasetStats,
                  thresholds: DriftThresholds | None = None) -> list[DriftFlag]:
    """The drift flags of `current` against `previous` (none without a previous day). Never raises for drift."""
    if previous is None:
        return []
    t = thresholds or DriftThresholds()
    flags: list[DriftFlag] = []
    if _ratio(previous.rows, current.rows) > t.rows_ratio:
        flags.append(DriftFlag(column=None, kind="rows", previous=previous.rows, current=current.rows,
                               threshold=t.rows_ratio, message=f"rows {previous.rows:,} -> {current.rows:,} "
                                                               f"(changed more than {t.rows_ratio:g}x)"))
    for name, c in current.columns.items():
        p = previous.columns.get(name)
        if p is None:
            flags.append(DriftFlag(column=name, kind="appeared", current=c.arrow_type,
                                   message=f"column {name!r} appeared ({c.role}, {c.arrow_type})"))
        else:
            flags += _column_flags(name, p, c, t)
    for name, p in previous.columns.items():
        if name not in current.columns:
            flags.append(DriftFlag(column=name, kind="disappeared", previous=p.arrow_type,
                                   message=f"column {name!r} disappeared ({p.role}, {p.arrow_type})"))
    return flags


def drifted_columns(flags: list[DriftFlag]) -> list[str]:
    """The columns with at least one flag, in flag order, each once."""
    return list(dict.fromkeys(f.column for f in flags if f.column is not None))
