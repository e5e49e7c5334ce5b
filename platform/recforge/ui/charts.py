"""Chart geometry for the page's inline SVGs (the templates draw it; every label is escaped there).

gantt(): RAP's co-run schedule, one lane per resource, one bar per task.
  Input: {"unit": "ms", "tasks": [{"name", "lane", "start", "end", "kind"?}, ...]} or just the task list.
step_series(): a value over time as a step line (the resource plan's worker count after each decision).
line_series(): a metric over training steps as a line (the training curve).
corun_gantt(): RAP's co-run schedule file (recforge.rap.planning.schedule.CorunSchedule JSON) over the profiled
  training stages, in gantt()'s input form.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# kinds RAP's Gantt charts use (recforge.rap.planning.gantt, corun_gantt below) get fixed colors: red is not hidden
KIND_COLORS = {"training stage": "#4e79a7", "hidden": "#59a14f", "not hidden": "#e15759", "spare capacity": "#cfd8e3",
               "planned kernels": "#9c755f", "measured kernels": "#f28e2b"}
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


def _color(kind: str, kinds: list[str]) -> str:
    return KIND_COLORS.get(kind) or PALETTE[kinds.index(kind) % len(PALETTE)]


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
             "h": LANE_H - 6, "color": _color(kind, kinds),
             "title": f"{name} [{lane}] {s:g}–{e:g} {unit}".strip()} for lane, name, kind, s, e in parsed]
    height = len(lanes) * LANE_H + AXIS_H
    return {
        "width": WIDTH, "height": height, "label_w": LABEL_W, "unit": unit,
        "lanes": [{"name": lane, "y": i * LANE_H + LANE_H / 2 + 4} for i, lane in enumerate(lanes)],
        "bars": bars,
        "ticks": [{"x": round(x(v), 2), "label": f"{v:g}"} for v in ticks(t0, t1)],
        "axis_y": len(lanes) * LANE_H,
        "legend": [{"name": k, "color": _color(k, kinds)} for k in kinds][:12],
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


def line_series(points: Sequence[tuple[float, float]], y_label: str,
                x_label: str = "step") -> dict[str, Any] | None:
    """points: (x, value), e.g. (step, train loss); the y axis spans the values' range. None: nothing to draw."""
    points = sorted((float(x), float(v)) for x, v in points if math.isfinite(x) and math.isfinite(v))
    if not points:
        return None
    height, top, bottom = 160, 10, 24
    x_lo, x_hi = points[0][0], max(points[-1][0], points[0][0] + 1.0)
    v_lo, v_hi = min(v for _, v in points), max(v for _, v in points)
    if v_hi - v_lo < 1e-12:
        v_lo, v_hi = v_lo - 0.5 * (abs(v_lo) or 1.0), v_hi + 0.5 * (abs(v_hi) or 1.0)
    plot_w, plot_h = WIDTH - LABEL_W - STEP_PAD, height - top - bottom

    def x(t: float) -> float:
        return LABEL_W + (t - x_lo) / (x_hi - x_lo) * plot_w

    def y(v: float) -> float:
        return top + plot_h - (v - v_lo) / (v_hi - v_lo) * plot_h

    last = points[-1]
    return {
        "width": WIDTH, "height": height, "label_w": LABEL_W, "y_label": y_label, "points": len(points),
        "polyline": " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in points),
        "last": {"x": round(x(last[0]), 1), "y": round(y(last[1]), 1),
                 "title": f"{x_label} {last[0]:g}: {y_label} {last[1]:.4g}"},
        "x_ticks": [{"x": round(x(v), 1), "label": f"{v:g}"} for v in ticks(x_lo, x_hi)],
        "y_ticks": [{"y": round(y(v), 1), "label": f"{v:.4g}"} for v in ticks(v_lo, v_hi, 4)],
        "axis_y": top + plot_h, "x_label": x_label,
    }


def corun_gantt(schedule: Any, stage_ms: Any, capacity_ms: Any) -> dict[str, Any]:
    """A co-run schedule as gantt() input: lane "train" holds the training stages back to back (their profiled
    times), lane "preprocess" each stage's fused kernels stacked from the stage's start; a kernel past its stage's
    spare capacity (not hidden behind training) is kind "not hidden" (as recforge.rap.planning.gantt.gantt_tasks)."""
    if not isinstance(schedule, dict) or not isinstance(schedule.get("assignments"), list):
        raise ChartError("co-run schedule has no assignment list")
    if not isinstance(stage_ms, dict) or not isinstance(capacity_ms, dict):
        raise ChartError("co-run schedule: no stage times to draw it over")
    stages = [str(s) for s in schedule.get("stages") or stage_ms]
    tasks: list[dict[str, Any]] = []
    start, starts = 0.0, {}
    for s in stages:
        d = _number({"name": s, "ms": stage_ms.get(s)}, "ms", len(tasks))
        starts[s] = start
        tasks.append({"name": s, "lane": "train", "start": start, "end": start + d, "kind": "training stage"})
        start += d
    used = dict.fromkeys(stages, 0.0)
    for i, a in enumerate(schedule["assignments"]):
        if not isinstance(a, dict) or a.get("stage") not in starts:
            raise ChartError(f"co-run assignment #{i} names no stage of the schedule")
        ms = _number(a, "predicted_ms", i)
        stage = a["stage"]
        t0 = starts[stage] + used[stage]
        used[stage] += ms
        cap = capacity_ms.get(stage)
        hidden = isinstance(cap, (int, float)) and used[stage] <= float(cap) + 1e-9
        tasks.append({"name": str(a.get("group", f"kernel {i}")), "lane": "preprocess", "start": t0,
                      "end": t0 + ms, "kind": "hidden" if hidden else "not hidden"})
    return {"unit": "ms", "tasks": tasks}
