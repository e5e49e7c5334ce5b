"""The ingest stage's data statistics: per-column statistics of an ingested split, drift against the previous day,
both logged to MLflow and recorded for the page. Drift is reported (task log warnings, MLflow, the page), never a
failure.

The previous day is found in a day-keyed history, `$RECFORGE_HOME/data_stats/<dataset>/<split>/<day>.json`, that
every ingest writes: the latest day before this one. Design: docs/data.md#column-statistics-and-drift.
"""
from __future__ import annotations

import json
import logging
import os
import re
from datetime import date
from pathlib import Path
from typing import Any

from recforge.data.drift import DriftFlag, DriftThresholds, compare_stats, drifted_columns
from recforge.data.stats import STATS_NAME, DatasetStats, compute_column_stats
from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import ColumnSummary, DataStatsOutputs, DriftFlagRecord

log = logging.getLogger("recforge.pipelines")

DRIFT_NAME = "drift.json"
PLOT_NAME = "missing_rate.png"
HISTORY_DIR = "data_stats"
UNDATED = "undated"
DRIFT_TAG = "recforge.drift_columns"  # the columns with drift flags, comma-separated ("" when none)
ARTIFACT_DIR = "data_stats"
_DAY_FILE = re.compile(r"^(\d{4}-\d{2}-\d{2})\.json$")


def day_of(ctx: RunContext, split: str) -> str | None:
    """The data day a split's statistics are keyed by: the last training day, the run's own day ("train"), or the
    day after (any other split), from the run's data_day; None for a run without one (outside Airflow)."""
    if ctx.data_day <= 0:
        return None
    last_train = ctx.data_day + ctx.config.train_days - 1
    return date.fromordinal(last_train if split == "train" else last_train + 1).isoformat()


def history_dir(ctx: RunContext, dataset: str, split: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset) or "dataset"
    return ctx.home / HISTORY_DIR / safe / split


def previous_stats(directory: Path, day: str | None, run_key: str) -> Path | None:
    """The stats file of the latest day before `day` in the history; for an undated run, the undated run recorded
    last (by modification time) other than `run_key`."""
    if day is None:
        undated = directory / UNDATED
        files = [p for p in undated.glob("*.json") if p.stem != run_key] if undated.is_dir() else []
        return max(files, key=lambda p: p.stat().st_mtime_ns, default=None)
    earlier = sorted(p for p in directory.glob("*.json") if (m := _DAY_FILE.match(p.name)) and m.group(1) < day)
    return earlier[-1] if earlier else None


def _metric_name(text: str) -> str:
    """MLflow metric names allow letters, digits, _ - . / and spaces."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", text)


def stats_metrics(stats: DatasetStats, prefix: str = "stats") -> dict[str, float]:
    out: dict[str, float] = {f"{prefix}.rows": float(stats.rows)}
    for name, c in stats.columns.items():
        key = f"{prefix}.{_metric_name(name)}"
        out[f"{key}.missing_rate"] = c.missing_rate
        out[f"{key}.distinct"] = float(c.distinct)
        for what in ("min", "max", "mean", "positive_rate", "mean_length"):
            value = getattr(c, what)
            if value is not None:
                out[f"{key}.{what}"] = float(value)
    return out


def missing_rate_plot(stats: DatasetStats, previous: DatasetStats | None, flagged: list[str], path: Path) -> Path:
    """Bar chart of the missing rate per column, this day next to the previous one; drifted columns in red."""
    import numpy as np  # lazy: numpy only where a chart is drawn
    from matplotlib.figure import Figure  # lazy: matplotlib only where a chart is drawn (no pyplot: no backend)

    names = list(stats.columns)
    if previous is not None:
        names += [n for n in previous.columns if n not in stats.columns]
    x = np.arange(len(names))
    now = [stats.columns[n].missing_rate if n in stats.columns else 0.0 for n in names]
    fig = Figure(figsize=(max(6.0, 0.28 * len(names) + 1.5), 3.6), dpi=100)
    ax = fig.add_subplot()
    width = 0.4 if previous is not None else 0.8
    if previous is not None:
        before = [previous.columns[n].missing_rate if n in previous.columns else 0.0 for n in names]
        ax.bar(x - width / 2, before, width, color="#9ca3af", label=f"previous ({previous.day or 'earlier run'})")
    colors = ["#dc2626" if n in flagged else "#017cee" for n in names]
    ax.bar(x + (width / 2 if previous is not None else 0), now, width, color=colors,
           label=f"this day ({stats.day or 'this run'})")
    ax.set_xticks(x, [n.replace("$", r"\$") for n in names], rotation=90, fontsize=7)  # no mathtext
    for name, label in zip(names, ax.get_xticklabels(), strict=True):
        if name in flagged:
            label.set_color("#dc2626")
            label.set_fontweight("bold")
    ax.set_ylabel("missing rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"{stats.dataset}: missing rate per column (drifted columns in red)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _load_previous(path: Path | None) -> DatasetStats | None:
    if path is None:
        return None
    try:
        return DatasetStats.load(path)
    except (OSError, ValueError) as e:  # a bad history file costs the comparison, not the run
        log.warning("data stats: cannot read the previous day's statistics %s (%s); no drift check", path, e)
        return None


def _write_json(path: Path, data: Any) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def record_data_stats(ctx: RunContext, store: Any, run_id: str, manifest_dir: str | Path, split: str,
                      thresholds: DriftThresholds | None = None) -> DataStatsOutputs:
    """Statistics of the split's shards (stats.json beside its manifest, and the day-keyed history), drift against
    the previous day (drift.json, one warning per flag), all logged to MLflow run `run_id`: metrics
    `stats.<column>.<what>` (`stats_<split>.` for another split than train) and `drift_flags`, the tag
    DRIFT_TAG, and artifacts under data_stats/<split>/. Paths returned are those under `manifest_dir`."""
    manifest_dir = Path(manifest_dir)
    day = day_of(ctx, split)
    stats = compute_column_stats(manifest_dir, day=day)
    stats_path = stats.save(manifest_dir / STATS_NAME)
    history = history_dir(ctx, stats.dataset, split)
    prev_path = previous_stats(history, day, ctx.run_key)
    previous = _load_previous(prev_path)
    flags: list[DriftFlag] = compare_stats(previous, stats, thresholds)
    columns = drifted_columns(flags)
    stats.save(history / f"{day}.json" if day is not None else history / UNDATED / f"{ctx.run_key}.json")

    against = f"{previous.day or 'an earlier run'} ({prev_path})" if previous is not None else None
    for f in flags:
        log.warning("data drift in %s %s vs %s: %s", split, day or ctx.run_key, previous and previous.day, f.message)
    if previous is None:
        log.info("data stats of %s %s: no earlier day of %s recorded in %s, no drift check", split,
                 day or ctx.run_key, stats.dataset, history)
    drift_path = _write_json(manifest_dir / DRIFT_NAME, {
        "dataset": stats.dataset, "split": split, "day": day, "previous_day": previous.day if previous else None,
        "previous_stats": str(prev_path) if previous is not None else None, "compared_against": against,
        "thresholds": (thresholds or DriftThresholds()).model_dump(), "drifted_columns": columns,
        "flags": [f.model_dump(mode="json") for f in flags]})
    plot_path: Path | None = None
    try:
        plot_path = missing_rate_plot(stats, previous, columns, manifest_dir / PLOT_NAME)
    except Exception:  # a chart is not worth a failed ingest
        log.exception("data stats: could not draw the missing-rate chart")

    prefix = "stats" if split == "train" else f"stats_{split}"
    train = split == "train"
    metrics = stats_metrics(stats, prefix)
    metrics["drift_flags" if train else f"{prefix}.drift_flags"] = float(len(flags))
    store.log_metrics(run_id, metrics)
    store.set_tags(run_id, {DRIFT_TAG if train else f"{DRIFT_TAG}.{split}": ",".join(columns)[:4900]})
    for path in (stats_path, drift_path, plot_path):
        if path is not None:
            store.log_artifact(run_id, path, f"{ARTIFACT_DIR}/{split}")

    return DataStatsOutputs(
        split=split, day=day, rows=stats.rows, stats_path=str(stats_path), drift_path=str(drift_path),
        plot_path=str(plot_path) if plot_path else None,
        previous_day=previous.day if previous else None,
        previous_stats=str(prev_path) if previous is not None else None,
        columns=[ColumnSummary(name=c.name, role=c.role, missing_rate=c.missing_rate, distinct=c.distinct,
                               distinct_exact=c.distinct_exact, min=c.min, max=c.max, mean=c.mean,
                               positive_rate=c.positive_rate, mean_length=c.mean_length)
                 for c in stats.columns.values()],
        flags=[DriftFlagRecord.model_validate(f.model_dump()) for f in flags],
        drifted_columns=columns,
    )
