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


def test_corun_gantt_stacks_each_stages_kernels_from_its_start_and_marks_what_is_not_hidden():
    stage_ms = {"emb_fwd": 4.0, "mlp_fwd": 2.0}
    capacity_ms = {"emb_fwd": 3.0, "mlp_fwd": 2.0}
    schedule = {"stages": ["emb_fwd", "mlp_fwd"], "assignments": [
        {"stage": "emb_fwd", "group": "g0", "predicted_ms": 1.5},
        {"stage": "emb_fwd", "group": "g1", "predicted_ms": 2.0},
        {"stage": "mlp_fwd", "group": "g2", "predicted_ms": 0.5}]}
    tasks = charts.corun_gantt(schedule, stage_ms, capacity_ms)["tasks"]
    spans = [(t["name"], t["lane"], t["start"], t["end"], t["kind"]) for t in tasks]
    assert spans == [("emb_fwd", "train", 0.0, 4.0, "training stage"), ("mlp_fwd", "train", 4.0, 6.0, "training stage"),
                     ("g0", "preprocess", 0.0, 1.5, "hidden"), ("g1", "preprocess", 1.5, 3.5, "not hidden"),
                     ("g2", "preprocess", 4.0, 4.5, "hidden")]
    assert len(charts.gantt({"unit": "ms", "tasks": tasks})["bars"]) == 5


@pytest.mark.parametrize("schedule,stage_ms,message", [
    ({"stages": ["a"]}, {"a": 1.0}, "no assignment list"),
    ({"stages": ["a"], "assignments": []}, None, "no stage times"),
    ({"stages": ["a"], "assignments": [{"stage": "b", "predicted_ms": 1}]}, {"a": 1.0}, "#0 names no stage"),
    ({"stages": ["a"], "assignments": []}, {"a": "x"}, "'ms' must be a finite number"),
    ({"stages": ["a"], "assignments": [{"stage": "a", "predicted_ms": None}]}, {"a": 1.0}, "'predicted_ms'"),
])
def test_corun_gantt_names_what_is_wrong(schedule, stage_ms, message):
    with pytest.raises(charts.ChartError, match=message):
        charts.corun_gantt(schedule, stage_ms, {"a": 1.0})


def test_line_series_spans_the_values_and_skips_what_is_not_finite():
    c = charts.line_series([(0, 0.7), (1, 0.6), (2, math.nan), (3, 0.5)], "train loss")
    xs_ys = [tuple(map(float, p.split(","))) for p in c["polyline"].split()]
    assert len(xs_ys) == 3 and c["points"] == 3
    assert xs_ys[0][0] == pytest.approx(charts.LABEL_W) and xs_ys[-1][0] == pytest.approx(
        charts.WIDTH - charts.STEP_PAD)
    assert xs_ys[0][1] == pytest.approx(10) and xs_ys[-1][1] == pytest.approx(c["axis_y"])  # top = max, bottom = min
    assert all(a[1] < b[1] for a, b in pairwise(xs_ys))  # loss falls: the line goes down
    assert c["last"]["title"] == "step 3: train loss 0.5"
    flat = charts.line_series([(0, 1.0), (5, 1.0)], "auc")
    assert len({p.split(",")[1] for p in flat["polyline"].split()}) == 1
    assert charts.line_series([], "x") is None and charts.line_series([(0, math.inf)], "x") is None
