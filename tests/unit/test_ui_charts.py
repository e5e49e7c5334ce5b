"""Chart geometry for the RecForge page: Gantt bars where a plain linear mapping puts them, bad schedules named."""
import math
from itertools import pairwise

import pytest

from recforge.ui import charts

TASKS = [
    {"name": "fill_null", "lane": "cpu0", "start": 2.0, "end": 5.0, "kind": "dense"},
    {"name": "sigrid_hash", "lane": "cpu1", "start": 3.0, "end": 12.0, "kind": "sparse"},
    {"name": "train", "lane": "gpu0", "start": 5.0, "end": 22.0, "kind": "train"},
    {"name": "logit", "lane": "cpu0", "start": 5.0, "end": 6.0, "kind": "dense"},
]


def test_gantt_bars_follow_a_linear_time_axis():
    g = charts.gantt({"unit": "ms", "tasks": TASKS})
    lo, hi = 2.0, 22.0
    plot_w = charts.WIDTH - charts.LABEL_W - charts.PAD
    for task, bar in zip(TASKS, g["bars"], strict=True):
        x0 = charts.LABEL_W + (task["start"] - lo) / (hi - lo) * plot_w
        x1 = charts.LABEL_W + (task["end"] - lo) / (hi - lo) * plot_w
        assert bar["x"] == pytest.approx(x0, abs=0.01) and bar["w"] == pytest.approx(x1 - x0, abs=0.01)
        assert charts.LABEL_W <= bar["x"] and bar["x"] + bar["w"] <= charts.WIDTH - charts.PAD + 0.01
    assert [lane["name"] for lane in g["lanes"]] == ["cpu0", "cpu1", "gpu0"]
    assert [b["y"] for b in g["bars"]] == [3, 3 + charts.LANE_H, 3 + 2 * charts.LANE_H, 3]
    assert g["bars"][0]["color"] == g["bars"][3]["color"] != g["bars"][1]["color"]  # same kind, same color
    assert g["makespan"] == 20.0 and g["height"] == 3 * charts.LANE_H + charts.AXIS_H
    assert "fill_null [cpu0] 2–5 ms" == g["bars"][0]["title"]


def test_gantt_accepts_a_bare_task_list_and_zero_length_tasks():
    g = charts.gantt([{"name": "a", "lane": "x", "start": 1, "end": 1}])
    assert g["bars"][0]["w"] >= 1.0 and g["unit"] == ""


@pytest.mark.parametrize("schedule,message", [
    ({"tasks": []}, "no task list"),
    ({"tasks": "x"}, "no task list"),
    ([{"name": "t", "lane": "l", "end": 3}], "'start' must be a finite number"),
    ([{"name": "t", "lane": "l", "start": 0, "end": float("nan")}], "'end' must be a finite number"),
    ([{"name": "t", "lane": "l", "start": True, "end": 2}], "'start' must be a finite number"),
    ([{"name": "late", "lane": "l", "start": 5, "end": 2}], "'late'.* ends before it starts"),
    (["not a task"], "task #0 is not an object"),
    ([{"name": "t", "lane": "l", "start": 0, "end": 1}] * (charts.MAX_TASKS + 1), "at most"),
])
def test_bad_schedules_are_named(schedule, message):
    with pytest.raises(charts.ChartError, match=message):
        charts.gantt(schedule)


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 22), (2, 22), (0.013, 0.9), (-5, 5), (100, 100_000)])
def test_ticks_cover_the_range_with_even_round_steps(lo, hi):
    t = charts.ticks(lo, hi)
    assert 2 <= len(t) <= 11 and lo <= t[0] and t[-1] <= hi
    steps = {round(b - a, 9) for a, b in pairwise(t)}
    assert len(steps) == 1
    step = steps.pop()
    assert t[0] - lo < step + 1e-9 and hi - t[-1] < step + 1e-9
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5, 10))


def test_step_series_draws_a_step_line_through_every_point():
    s = charts.step_series([(0.0, 2), (30.0, 3), (10.0, 2)], "workers")
    points = [tuple(map(float, p.split(","))) for p in s["polyline"].split()]
    # sorted by time; each change is a horizontal then a vertical segment; the last value runs to the end
    assert len(points) == 2 * 3
    assert all(a[0] <= b[0] for a, b in pairwise(points))
    assert points[-1][0] == pytest.approx(charts.WIDTH - charts.STEP_PAD) and points[-1][1] == points[-2][1]
    assert [d["title"] for d in s["dots"]] == ["0 s: workers 2", "10 s: workers 2", "30 s: workers 3"]
    assert all(t["label"].endswith(" s") for t in s["x_ticks"])
    by_decision = charts.step_series([(0, 2), (1, 2), (2, 1)], "workers", x_label="decision")
    assert [t["label"] for t in by_decision["x_ticks"]] == ["decision 0", "decision 1", "decision 2"]
    assert charts.step_series([], "workers") is None
