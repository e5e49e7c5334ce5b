"""Gantt chart of a co-run schedule over the training stages (matplotlib PNG, logged to MLflow).

gantt_tasks() / measured_gantt(): the same as data for the RecForge run page ({unit, tasks: [{name, lane, start,
end, kind}]}): the plan task's schedule, and the timeline a worker measured while co-running.

Top lane: the training stages back to back (their profiled durations), hatched where the stage has spare
capacity. Lower lane: the preprocessing kernels (parts) each stage runs, stacked from the stage's start;
a bar past its stage's capacity is drawn red (that much is not hidden).
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recforge.rap.planning.schedule import CorunSchedule
from recforge.rap.profiling.stages import STAGES


def figure(schedule: CorunSchedule, stage_ms: Mapping[str, float], capacity_ms: Mapping[str, float],
           title: str | None = None):
    import matplotlib  # lazy: matplotlib only when a chart is drawn

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # lazy: after choosing the Agg backend

    fig, ax = plt.subplots(figsize=(10, 2.8))
    colors = plt.get_cmap("tab10")
    start = 0.0
    starts = {}
    for i, s in enumerate(STAGES):
        d = stage_ms[s]
        starts[s] = start
        ax.broken_barh([(start, d)], (10, 8), facecolors=colors(i), alpha=0.5)
        ax.broken_barh([(start, min(capacity_ms[s], d))], (10, 8), facecolors="none", hatch="//", edgecolor="k",
                       linewidth=0)
        ax.text(start + d / 2, 14, s, ha="center", va="center", fontsize=8)
        start += d
    for s, items in schedule.by_stage().items():
        t = starts[s]
        for a in items:
            over = t + a.predicted_ms > starts[s] + capacity_ms[s] + 1e-12
            ax.broken_barh([(t, a.predicted_ms)], (0, 8), facecolors="tab:red" if over else "tab:gray",
                           edgecolor="k", linewidth=0.5)
            if a.predicted_ms > 0.04 * start:
                ax.text(t + a.predicted_ms / 2, 4, a.group.split(":")[1][:14], ha="center", va="center", fontsize=6,
                        rotation=90 if a.predicted_ms < 0.1 * start else 0)
            t += a.predicted_ms
    ax.set_yticks([4, 14], ["preprocess", "train"])
    ax.set_xlabel("ms in one iteration")
    ax.set_xlim(0, max(start, 1e-9) * 1.02)
    ax.set_title(title or f"co-run schedule: {schedule.plan_name}", fontsize=9)
    fig.tight_layout()
    return fig


def save_png(schedule: CorunSchedule, stage_ms: Mapping[str, float], capacity_ms: Mapping[str, float],
             path: str | Path, title: str | None = None) -> Path:
    import matplotlib.pyplot as plt  # lazy: matplotlib only when a chart is drawn

    fig = figure(schedule, stage_ms, capacity_ms, title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def log_schedule(schedule: CorunSchedule, stage_ms: Mapping[str, float], capacity_ms: Mapping[str, float],
                 store, run_id: str, name: str = "rap/schedule") -> None:
    """The schedule JSON and its Gantt PNG into an MLflow run (recforge.tracking.TrackingStore)."""
    import matplotlib.pyplot as plt  # lazy: matplotlib only when a chart is drawn

    store.log_dict(run_id, json.loads(schedule.to_json()), f"{name}.json")
    fig = figure(schedule, stage_ms, capacity_ms)
    store.log_figure(run_id, fig, f"{name}.png")
    plt.close(fig)


def _stage_starts(stage_ms: Mapping[str, float]) -> dict[str, float]:
    missing = [s for s in STAGES if s not in stage_ms]
    if missing:
        raise ValueError(f"Gantt: stages {missing} have no duration")
    starts, t = {}, 0.0
    for s in STAGES:
        starts[s] = t
        t += float(stage_ms[s])
    return starts


def _task(name: str, lane: str, start: float, end: float, kind: str) -> dict[str, Any]:
    return {"name": name, "lane": lane, "start": round(start, 4), "end": round(end, 4), "kind": kind}


def gantt_tasks(jobs: Sequence[tuple[str, CorunSchedule]], stage_ms: Mapping[str, float],
                capacity_ms: Mapping[str, float]) -> dict[str, Any]:
    """A planned co-run as the run page's Gantt: the training stages back to back, each stage's spare capacity,
    and every job's kernels (lane `preprocess` or `preprocess: <job>`) stacked from the stage's start in the order
    the co-run thread runs them (job by job); a kernel ending past the stage's capacity is kind 'not hidden'."""
    starts = _stage_starts(stage_ms)
    tasks = [_task(s, "train", starts[s], starts[s] + stage_ms[s], "training stage") for s in STAGES]
    tasks += [_task(f"{s} spare capacity", "spare capacity", starts[s], starts[s] + capacity_ms[s], "spare capacity")
              for s in STAGES if capacity_ms.get(s, 0.0) > 0]
    for s in STAGES:
        t, edge = starts[s], starts[s] + capacity_ms.get(s, 0.0)
        for job, sched in jobs:
            for a in sched.by_stage().get(s, []):
                kind = "hidden" if t + a.predicted_ms <= edge + 1e-9 else "not hidden"
                tasks.append(_task(a.group, f"preprocess: {job}" if job else "preprocess", t, t + a.predicted_ms, kind))
                t += a.predicted_ms
    return {"unit": "ms", "tasks": tasks}


def measured_gantt(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """A worker's co-run (CorunSession.summary) as the run page's Gantt: the measured stage medians back to back,
    the planned kernel time of each stage and the measured one (medians, all jobs) from the stage's start, and
    the trainer's wait for leftover kernels after the step. None without measured stages."""
    stage_ms = summary.get("measured_stage_ms") or {}
    if not set(stage_ms) >= set(STAGES):
        return None
    starts = _stage_starts(stage_ms)
    tasks = [_task(s, "train (measured)", starts[s], starts[s] + stage_ms[s], "training stage") for s in STAGES]
    docs = list(((summary.get("mapped") or {}).get("schedules") or {}).values()) or [summary.get("schedule")]
    planned = {s: 0.0 for s in STAGES}
    for doc in docs:
        if doc:
            for s, ms in CorunSchedule.from_json(json.dumps(doc)).predicted_ms_by_stage().items():
                planned[s] = planned.get(s, 0.0) + ms
    tasks += [_task(f"{s}: planned kernels", "kernels (planned)", starts[s], starts[s] + ms, "planned kernels")
              for s, ms in planned.items() if s in starts and ms > 0]
    tasks += [_task(f"{s}: kernels", "kernels (measured)", starts[s], starts[s] + float(ms), "measured kernels")
              for s, ms in (summary.get("kernel_ms_by_stage") or {}).items() if s in starts and ms > 0]
    wait, end = float(summary.get("wait_ms") or 0.0), starts[STAGES[-1]] + stage_ms[STAGES[-1]]
    if wait > 0:
        tasks.append(_task("trainer waits for preprocessing", "trainer waits", end, end + wait, "not hidden"))
    return {"unit": "ms", "tasks": tasks}
