"""Compare policies: a table (rich), JSON, and plots (JCT CDF, utilization and completion bars)."""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

PAPER = {"jct_median_change": -0.31, "completion_points": 6.0, "cpu_points": 15.0, "memory_points": 20.0}


def paired_jct(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median / mean JCT over the jobs that every policy completed (failures drop different jobs per policy)."""
    done_sets = [{p["job"] for p in r["per_job"] if p["status"] == "done"} for r in results]
    common = set.intersection(*done_sets) if done_sets else set()
    out = {}
    for r in results:
        jct = np.array([p["jct_h"] for p in r["per_job"] if p["job"] in common])
        out[r["policy"]] = {"jobs": int(len(jct)), "median_h": float(np.median(jct)) if len(jct) else math.nan,
                            "mean_h": float(jct.mean()) if len(jct) else math.nan}
    return out


def versus(results: Sequence[dict[str, Any]], baseline: str = "static") -> dict[str, dict[str, float]]:
    """Each policy against the baseline, in the paper's terms (relative JCT, percentage points)."""
    base = next((r for r in results if r["policy"] == baseline), None)
    if base is None:
        return {}
    paired = paired_jct(results)
    out = {}
    for r in results:
        if r["policy"] == baseline:
            continue
        out[r["policy"]] = {
            "jct_median_change": r["jct_median_h"] / base["jct_median_h"] - 1,
            "jct_mean_change": r["jct_mean_h"] / base["jct_mean_h"] - 1,
            "jct_median_change_common_jobs": paired[r["policy"]]["median_h"] / paired[baseline]["median_h"] - 1,
            "completion_points": 100 * (r["completion_rate"] - base["completion_rate"]),
            "cpu_points": 100 * (r["cpu_utilization"] - base["cpu_utilization"]),
            "memory_points": 100 * (r["memory_utilization"] - base["memory_utilization"]),
        }
    return out


def summary(results: Sequence[dict[str, Any]], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    slim = [{k: v for k, v in r.items() if k not in ("per_job", "jct_h")} for r in results]
    return {"meta": meta or {}, "policies": slim, "versus_static": versus(results), "paired_jct": paired_jct(results),
            "paper_versus_static": PAPER}


def table(results: Sequence[dict[str, Any]], title: str = "cluster simulation"):
    t = Table(title=title)
    for col in ("policy", "completed", "JCT mean h", "JCT median h", "JCT p95 h", "queue median h", "CPU util",
                "mem util", "cluster CPU alloc", "plan changes"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r["policy"], f"{r['completion_rate']:.1%} ({r['completed']}/{r['jobs']})", f"{r['jct_mean_h']:.2f}",
                  f"{r['jct_median_h']:.2f}", f"{r['jct_p95_h']:.2f}", f"{r['queue_median_h']:.2f}",
                  f"{r['cpu_utilization']:.1%}", f"{r['memory_utilization']:.1%}", f"{r['cluster_cpu_allocated']:.1%}",
                  str(r["plan_changes"]))
    return t


def versus_table(results: Sequence[dict[str, Any]]):
    t = Table(title="against static (paper: median JCT -31%, completion +6 pts, CPU +15 pts, memory +20 pts)")
    for col in ("policy", "median JCT", "median JCT (jobs all completed)", "completion", "CPU util", "mem util"):
        t.add_column(col, justify="right")
    for name, v in versus(results).items():
        t.add_row(name, f"{v['jct_median_change']:+.1%}", f"{v['jct_median_change_common_jobs']:+.1%}",
                  f"{v['completion_points']:+.1f} pts", f"{v['cpu_points']:+.1f} pts", f"{v['memory_points']:+.1f} pts")
    return t


def write(results: Sequence[dict[str, Any]], out_dir: str | Path,
          meta: dict[str, Any] | None = None) -> dict[str, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "simulation.json"}
    paths["json"].write_text(json.dumps(summary(results, meta), indent=2, default=str))
    paths.update(plot(results, out_dir))
    return paths


def plot(results: Sequence[dict[str, Any]], out_dir: Path) -> dict[str, Path]:
    import matplotlib  # lazy: matplotlib only where plots are written

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        x = np.array(r["jct_h"])
        if len(x):
            ax.plot(np.sort(x), np.arange(1, len(x) + 1) / r["jobs"], label=r["policy"])
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (h)")
    ax.set_ylabel("fraction of all jobs completed")
    ax.set_title("JCT CDF (failed jobs never reach 1.0)")
    ax.legend()
    fig.tight_layout()
    cdf = out_dir / "jct_cdf.png"
    fig.savefig(cdf, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(10, 3.5))
    names = [r["policy"] for r in results]
    for ax, key, label in zip(axes, ("completion_rate", "cpu_utilization", "memory_utilization"),
                              ("completion rate", "CPU utilization", "memory utilization"), strict=True):
        ax.bar(names, [100 * r[key] for r in results], color=["#999", "#69c", "#c63", "#6a6", "#a6a"][: len(names)])
        ax.set_title(label)
        ax.set_ylabel("%")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    bars = out_dir / "utilization.png"
    fig.savefig(bars, dpi=120)
    plt.close(fig)
    return {"jct_cdf": cdf, "bars": bars}
