"""Gantt chart of a co-run schedule over the training stages (matplotlib PNG, logged to MLflow).

Top lane: the training stages back to back (their profiled durations), hatched where the stage has spare
capacity. Lower lane: the preprocessing kernels (parts) each stage runs, stacked from the stage's start;
a bar past its stage's capacity is drawn red (that much is not hidden).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

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
