"""Chart geometry for the page's inline SVGs (the templates draw it; every label is escaped there).

gantt(): RAP's co-run schedule, one lane per resource, one bar per task.
  Input: {"unit": "ms", "tasks": [{"name", "lane", "start", "end", "kind"?}, ...]} or just the task list.
step_series(): a value over time as a step line (the resource plan's worker count after each decision).
"""
from __future__ import annotations

import math
from typing import Any

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
WIDTH, LABEL_W, LANE_H, AXIS_H, PAD = 920, 150, 22, 24, 10
STEP_PAD = 60  # room for the last x label of a step chart
MAX_TASKS = 2000


class ChartError(ValueError):
    pass


def _number(task: dict, key: str, i: int) -> float:
    value = task.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ChartError(f"schedule task #{i} ({task.get('name')!r}): {key!r} must be a finite number, got {value!r}")
    return float(value)


def ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + k * step, 10) for k in range(int((hi - first) / step + 1e-9) + 1)]


def gantt(schedule: Any) -> dict[str, Any]:
    tasks = schedule.get("tasks") if isinstance(schedule, dict) else schedule
    unit = str(schedule.get("unit", "")) if isinstance(schedule, dict) else ""
    if not isinstance(tasks, list) or not tasks:
        raise ChartError("schedule has no task list")
    if len(tasks) > MAX_TASKS:
        raise ChartError(f"schedule has {len(tasks)} tasks; the chart draws at most {MAX_TASKS}")
    parsed = []
    for i, t in enumerate(tasks):
        if not isinstance(t, dict):
            raise ChartError(f"schedule task #{i} is not an object")
        start, end = _number(t, "start", i), _number(t, "end", i)
        if end < start:
            raise ChartError(f"schedule task #{i} ({t.get('name')!r}) ends before it starts")
        parsed.append((str(t.get("lane", "")), str(t.get("name", f"task {i}")), str(t.get("kind", t.get("name", ""))),
                       start, end))
    lanes = list(dict.fromkeys(p[0] for p in parsed))
    kinds = list(dict.fromkeys(p[2] for p in parsed))
    t0, t1 = min(p[3] for p in parsed), max(p[4] for p in parsed)
    span = (t1 - t0) or 1.0
    plot_w = WIDTH - LABEL_W - PAD

    def x(t: float) -> float:
        return LABEL_W + (t - t0) / span * plot_w

    bars = [{"x": round(x(s), 2), "y": lanes.index(lane) * LANE_H + 3, "w": round(max(x(e) - x(s), 1.0), 2),
             "h": LANE_H - 6, "color": PALETTE[kinds.index(kind) % len(PALETTE)],
             "title": f"{name} [{lane}] {s:g}–{e:g} {unit}".strip()} for lane, name, kind, s, e in parsed]
    height = len(lanes) * LANE_H + AXIS_H
    return {
        "width": WIDTH, "height": height, "label_w": LABEL_W, "unit": unit,
        "lanes": [{"name": lane, "y": i * LANE_H + LANE_H / 2 + 4} for i, lane in enumerate(lanes)],
        "bars": bars,
        "ticks": [{"x": round(x(v), 2), "label": f"{v:g}"} for v in ticks(t0, t1)],
        "axis_y": len(lanes) * LANE_H,
        "legend": [{"name": k, "color": PALETTE[i % len(PALETTE)]} for i, k in enumerate(kinds)][:12],
        "makespan": t1 - t0,
    }


def step_series(points: list[tuple[float, float]], y_label: str, x_label: str = "s") -> dict[str, Any] | None:
    """points: (x >= 0, value), x in seconds or a sequence number; None when there is nothing to draw."""
    points = [(float(t), float(v)) for t, v in points if math.isfinite(t) and math.isfinite(v)]
    if not points:
        return None
    points.sort()
    height, top, bottom = 160, 10, 24
    t_hi = max(points[-1][0], 1.0)
    v_hi = max(max(v for _, v in points), 1.0)
    plot_w, plot_h = WIDTH - LABEL_W - STEP_PAD, height - top - bottom

    def x(t: float) -> float:
        return LABEL_W + t / t_hi * plot_w

    def y(v: float) -> float:
        return top + plot_h - v / v_hi * plot_h

    def x_name(v: float) -> str:
        return f"{v:g} s" if x_label == "s" else f"{x_label} {v:g}"

    path, prev = [], None
    for t, v in points:
        if prev is not None:
            path.append(f"{x(t):.1f},{y(prev):.1f}")
        path.append(f"{x(t):.1f},{y(v):.1f}")
        prev = v
    path.append(f"{x(t_hi):.1f},{y(points[-1][1]):.1f}")  # the last value held to the right edge
    return {
        "width": WIDTH, "height": height, "label_w": LABEL_W, "y_label": y_label, "polyline": " ".join(path),
        "dots": [{"x": round(x(t), 1), "y": round(y(v), 1), "title": f"{x_name(t)}: {y_label} {v:g}"}
                 for t, v in points],
        "x_ticks": [{"x": round(x(v), 1), "label": x_name(v)} for v in ticks(0.0, t_hi)
                    if x_label == "s" or float(v).is_integer()],
        "y_ticks": [{"y": round(y(v), 1), "label": f"{v:g}"} for v in ticks(0.0, v_hi, 4)],
        "axis_y": top + plot_h,
    }
