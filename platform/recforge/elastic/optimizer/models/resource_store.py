"""DLRover-RM's fitted models and job history in MLflow, through recforge.tracking.resource_models.

`log_resource_model` logs a job's throughput and memory models as history and as a pyfunc whose
input is a DataFrame with columns workers, cpu_per_worker, batch_size (optional: servers,
cpu_per_server, host_cores, embedding_bytes, step) and whose output has columns samples_per_s and
memory_bytes (`ResourcePredictor`). `MlflowHistory` implements `History` over those runs. A run whose
record is missing or corrupt still gives its final plan and lands in `problems` with the reason.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from recforge.elastic.optimizer.models.history import JobRecord
from recforge.elastic.optimizer.models.memory_model import MemoryModel
from recforge.elastic.optimizer.models.throughput_model import Allocation, ModelFitError, Sample, ThroughputModel
from recforge.tracking.resource_models import (
    STORE_ERRORS,
    ResourceModelRecord,
    find_resource_runs,
    record_problem,
    registered_versions,
)
from recforge.tracking.resource_models import log_resource_model as _log_record
from recforge.tracking.store import TrackingStore

PREDICTOR_PACKAGES = ("numpy", "scipy", "pandas")


class ResourcePredictor:
    """Throughput (samples/s) and per-worker memory (bytes) for resource configurations."""

    def __init__(self, throughput: ThroughputModel, memory: MemoryModel | None) -> None:
        self.throughput = throughput
        self.memory = memory

    def __call__(self, model_input: Any) -> pd.DataFrame:
        df = pd.DataFrame(model_input)
        missing = [c for c in ("workers", "cpu_per_worker", "batch_size") if c not in df.columns]
        if missing:
            raise ValueError(f"resource model input lacks columns {missing}; got {list(df.columns)}")
        allocs = []
        for row in df.to_dict("records"):
            host = row.get("host_cores")
            allocs.append(Allocation(int(row["workers"]), float(row["cpu_per_worker"]), int(row["batch_size"]),
                                     int(row.get("servers", 0) or 0), float(row.get("cpu_per_server", 0) or 0),
                                     None if host is None or pd.isna(host) else float(host)))
        out = pd.DataFrame({"samples_per_s": self.throughput.predict(allocs)})
        if self.memory is not None:
            emb = df["embedding_bytes"] if "embedding_bytes" in df else 0.0
            step = df["step"] if "step" in df else 0.0
            out["memory_bytes"] = (self.memory.base_bytes + self.memory.emb_factor * emb
                                   + self.memory.growth_per_step * step)
        return out


def load_predictor(path: str, model_config: Mapping[str, Any]) -> ResourcePredictor:
    """The pyfunc's loader: the models of the record file at `path`."""
    record = json.loads(Path(path).read_text())
    memory = MemoryModel.from_dict(record["memory_model"]) if record.get("memory_model") else None
    return ResourcePredictor(ThroughputModel.from_dict(record["throughput_model"]), memory)


def predicted_vs_measured_figure(model: ThroughputModel, points: Sequence[Sample], held_out: Sequence[Sample] = (),
                                 title: str = "resource model"):
    """Predicted against measured samples/s (log-log, y = x for reference), one marker per point set."""
    import matplotlib  # lazy: matplotlib only where a figure is drawn

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for pts, label, marker in ((points, "fitted on", "o"), (held_out, "held out", "^")):
        if not pts:
            continue
        meas = [p.samples_per_s for p in pts]
        pred = model.predict([p.allocation for p in pts])
        ax.scatter(meas, pred, label=label, marker=marker, alpha=0.8)
        for p, x, y in zip(pts, meas, pred, strict=True):
            a = p.allocation
            ax.annotate(f"{a.workers}w{a.cpu_per_worker:g}c b{a.batch_size}", (x, y), fontsize=6, alpha=0.7)
    every = [p.samples_per_s for p in list(points) + list(held_out)]
    if every:
        lo, hi = min(every) * 0.8, max(every) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("measured samples/s")
    ax.set_ylabel("predicted samples/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def log_resource_model(store: TrackingStore, run_id: str, *, model: ThroughputModel, dataset: str, model_family: str,
                       final_plan: dict[str, Any], memory: MemoryModel | None = None,
                       samples_per_s: float | None = None, peak_memory_bytes: float | None = None,
                       points: Sequence[Sample] = (), held_out: Sequence[Sample] = (),
                       metrics: dict[str, float] | None = None, extra: dict[str, Any] | None = None,
                       register: bool = False) -> str:
    """Log a job's fitted models as history and as a loadable pyfunc; returns the model URI.

    Metrics: fit_mape, coef.<term> and `metrics` (as resource_model.<name>); with `points` / `held_out`,
    the predicted-vs-measured figure. With `register`, the model also becomes a version of the
    registered model `registered_name(dataset, model_family)` (`load_resource_model(name=...)`).
    """
    record = ResourceModelRecord(dataset=dataset, model_family=model_family, final_plan=final_plan,
                                 throughput_model=model.to_dict(), memory_model=memory.to_dict() if memory else None,
                                 samples_per_s=samples_per_s, peak_memory_bytes=peak_memory_bytes, extra=extra or {})
    m = {"fit_mape": model.fit_mape, **{f"coef.{t}": c for t, c in zip(model.terms, model.coef, strict=True)},
         **(metrics or {})}
    fig = None
    if points or held_out:
        fig = predicted_vs_measured_figure(model, points, held_out, f"{dataset}/{model_family}: {model.describe()}")
    try:
        return _log_record(store, run_id, record, loader=load_predictor, requirements=PREDICTOR_PACKAGES, metrics=m,
                           figure=fig, register=register,
                           version_tags={"fit_mape": f"{model.fit_mape:.4f}",
                                         "final_plan": json.dumps(final_plan, sort_keys=True)})
    finally:
        if fig is not None:
            import matplotlib.pyplot as plt  # lazy: matplotlib only where a figure is drawn

            plt.close(fig)


class MlflowHistory:
    """Past jobs from MLflow runs tagged by `log_resource_model` (any experiment of the store)."""

    def __init__(self, store: TrackingStore, max_runs: int = 50) -> None:
        self.store = store
        self.max_runs = max_runs
        self.problems: list[str] = []
        self.unavailable: tuple[type[Exception], ...] = STORE_ERRORS

    def similar(self, dataset: str, model_family: str, limit: int = 20) -> list[JobRecord]:
        """Newest first; a run whose model is a registered version carries it in extra["registered_version"]."""
        runs = find_resource_runs(self.store, dataset, model_family, limit=min(limit, self.max_runs))
        versions = registered_versions(self.store, dataset, model_family)
        out = [self._record(r, dataset, model_family) for r in runs]
        for rec in out:
            if rec.run_id in versions:
                rec.extra["registered_version"] = versions[rec.run_id]
        return out

    def _record(self, run, dataset: str, model_family: str) -> JobRecord:
        self.problems.extend(run.problems)
        rec = JobRecord(dataset=dataset, model_family=model_family, final_plan=run.final_plan,
                        finished_at=run.finished_at, run_id=run.run_id)
        if run.record is None:
            return rec
        data = run.record
        try:
            rec.model = ThroughputModel.from_dict(data["throughput_model"])
            rec.memory = MemoryModel.from_dict(data["memory_model"]) if data.get("memory_model") else None
            rec.samples_per_s = data.get("samples_per_s")
            rec.peak_memory_bytes = data.get("peak_memory_bytes")
            rec.extra = dict(data.get("extra") or {})
            rec.final_plan = data.get("final_plan") or run.final_plan
        except (KeyError, TypeError, ModelFitError) as e:
            self.problems.append(record_problem(run.run_id, e))
        return rec
