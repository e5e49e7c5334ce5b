"""Fitted resource-performance models in MLflow: log one per job, read them back as history.

`log_resource_model` puts into a run:
  - an MLflow model `resource_model` (pyfunc): input a DataFrame with columns workers, cpu_per_worker,
    batch_size (optional: servers, cpu_per_server, host_cores, embedding_bytes, step), output columns
    samples_per_s and memory_bytes. Load it with `load_resource_model(uri)` or mlflow.pyfunc.load_model;
  - `resource_model/record.json`: the job record (final plan, throughput and memory models, fit errors);
  - metrics fit_mape / cv_mape / heldout_mape and coef.<term>, params terms, tags the history search uses;
  - `resource_model/predicted_vs_measured.png` when measured points are given.
`MlflowHistory` implements recforge.elastic.optimizer.history.History over those runs. A run whose record is
missing or corrupt still gives its final plan (tag) and lands in `problems` with the reason.
"""
from __future__ import annotations

import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

import mlflow
import mlflow.pyfunc
from mlflow.exceptions import MlflowException

from recforge.elastic.optimizer.history import JobRecord
from recforge.elastic.optimizer.memory_model import MemoryModel
from recforge.elastic.optimizer.throughput_model import Allocation, ModelFitError, Sample, ThroughputModel
from recforge.tracking.store import TrackingStore

log = logging.getLogger(__name__)

MODEL_TAG = "recforge.resource_model"
DATASET_TAG = "recforge.dataset"
FAMILY_TAG = "recforge.model_family"
PLAN_TAG = "recforge.final_plan"
RECORD_FILE = "resource_model/record.json"
EVENTS_FILE = "resource_model/events.jsonl"
MODEL_NAME = "resource_model"
REGISTRY_PREFIX = "recforge-resource-model"


class ResourceModelPyfunc(mlflow.pyfunc.PythonModel):
    """Throughput (samples/s) and per-worker memory (bytes) for resource configurations."""

    def load_context(self, context) -> None:
        record = json.loads(Path(context.artifacts["record"]).read_text())
        self.throughput = ThroughputModel.from_dict(record["throughput_model"])
        self.memory = MemoryModel.from_dict(record["memory_model"]) if record.get("memory_model") else None

    def predict(self, context, model_input, params=None):
        import pandas as pd

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
            out["memory_bytes"] = self.memory.base_bytes + self.memory.emb_factor * emb + self.memory.growth_per_step * step
        return out


def predicted_vs_measured_figure(model: ThroughputModel, points: Sequence[Sample], held_out: Sequence[Sample] = (),
                                 title: str = "resource model"):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for pts, label, marker in ((points, "fitted on", "o"), (held_out, "held out", "^")):
        if not pts:
            continue
        meas = [p.samples_per_s for p in pts]
        pred = model.predict([p.allocation for p in pts])
        ax.scatter(meas, pred, label=label, marker=marker, alpha=0.8)
        for p, x, y in zip(pts, meas, pred):
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
                       final_plan: dict[str, Any], memory: MemoryModel | None = None, samples_per_s: float | None = None,
                       peak_memory_bytes: float | None = None, points: Sequence[Sample] = (),
                       held_out: Sequence[Sample] = (), metrics: dict[str, float] | None = None,
                       extra: dict[str, Any] | None = None, register: bool = False) -> str:
    """Log a job's fitted model as history and as a loadable pyfunc; returns the model URI. With
    `register`, the model also becomes a version of the registered model `registered_name(dataset,
    model_family)` (browsable in the MLflow UI's Models page; `load_resource_model(name=...)`)."""
    record = {"dataset": dataset, "model_family": model_family, "final_plan": final_plan,
              "samples_per_s": samples_per_s, "peak_memory_bytes": peak_memory_bytes,
              "throughput_model": model.to_dict(), "memory_model": memory.to_dict() if memory else None,
              "extra": extra or {}}
    store.set_tags(run_id, {MODEL_TAG: "1", DATASET_TAG: dataset, FAMILY_TAG: model_family,
                            PLAN_TAG: json.dumps(final_plan, sort_keys=True)})
    m = {"resource_model.fit_mape": model.fit_mape, **{f"resource_model.coef.{t}": c for t, c in zip(model.terms, model.coef)}}
    m.update({f"resource_model.{k}": v for k, v in (metrics or {}).items()})
    store.log_metrics(run_id, {k: v for k, v in m.items() if v == v})  # drop NaN
    store.log_dict(run_id, record, RECORD_FILE)
    if points or held_out:
        import matplotlib.pyplot as plt

        fig = predicted_vs_measured_figure(model, points, held_out, f"{dataset}/{model_family}: {model.describe()}")
        store.log_figure(run_id, fig, "resource_model/predicted_vs_measured.png")
        plt.close(fig)
    mlflow.set_tracking_uri(store.tracking_uri)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "record.json"
        path.write_text(json.dumps(record, indent=2, default=str))
        with mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None), warnings.catch_warnings():
            # predict takes a DataFrame of any of the documented columns: no type-hint signature to infer
            warnings.filterwarnings("ignore", message=".*type hints.*")
            info = mlflow.pyfunc.log_model(name=MODEL_NAME, python_model=ResourceModelPyfunc(),
                                           artifacts={"record": str(path)}, pip_requirements=_requirements())
    if register:
        register_resource_model(store, run_id, info, registered_name(dataset, model_family),
                                tags={"fit_mape": f"{model.fit_mape:.4f}", "final_plan": json.dumps(final_plan, sort_keys=True)})
    return info.model_uri


def registered_name(dataset: str, model_family: str) -> str:
    """One registered model per dataset preset and model family: its versions are the daily jobs' fits."""
    return f"{REGISTRY_PREFIX}-{dataset}-{model_family}"


def register_resource_model(store: TrackingStore, run_id: str, info, name: str,
                            tags: dict[str, str] | None = None) -> str:
    """Register a logged resource model (idempotent per run: a retried task finds its version)."""
    client = store.client
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="recforge DLRover-RM resource-performance model: "
                                       "samples/s and memory per resource configuration")
    existing = client.search_model_versions(f"name = '{_q(name)}' and run_id = '{run_id}'")
    if existing:
        return str(max((v.version for v in existing), key=int))
    mv = client.create_model_version(name, source=info.model_uri, run_id=run_id, tags=tags or {},
                                     model_id=getattr(info, "model_id", None))
    return str(mv.version)


def log_events(store: TrackingStore, run_id: str, events: Sequence[Any], prefix: str = "dlrover") -> None:
    """Every optimizer decision as JSON lines (one artifact) plus a count per stage and action."""
    from recforge.elastic.optimizer.events import to_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.jsonl"
        path.write_text(to_jsonl(events))
        store.log_artifact(run_id, path, "resource_model")
    counts: dict[str, float] = {}
    for e in events:
        counts[f"{prefix}.events.{e.stage}"] = counts.get(f"{prefix}.events.{e.stage}", 0) + 1
    store.log_metrics(run_id, counts)


def load_resource_model(model_uri: str | None = None, tracking_uri: str | None = None, *, name: str | None = None,
                        version: str | int | None = None):
    """The pyfunc: `.predict(pd.DataFrame({"workers": [8], "cpu_per_worker": [2], "batch_size": [512]}))`.

    Either a model URI (runs:/..., models:/...) or a registered `name` (see `registered_name`) with a
    `version` (a number, an alias, or None for the newest version)."""
    if (model_uri is None) == (name is None):
        raise ValueError("load_resource_model: give either model_uri or name (with an optional version)")
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    if name is not None:
        v = "latest" if version is None else str(version)
        model_uri = f"models:/{name}/{v}" if v.isdigit() or v == "latest" else f"models:/{name}@{v}"
    try:
        return mlflow.pyfunc.load_model(model_uri)
    except MlflowException as e:
        raise MlflowException(f"resource model {model_uri!r} cannot be loaded: {e.message}") from e


def _requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{p}=={version(p)}" for p in ("numpy", "scipy", "pandas")]


class MlflowHistory:
    """Past jobs from MLflow runs tagged by `log_resource_model` (any experiment of the store)."""

    def __init__(self, store: TrackingStore, max_runs: int = 50) -> None:
        self.store = store
        self.max_runs = max_runs
        self.problems: list[str] = []

    def similar(self, dataset: str, model_family: str, limit: int = 20) -> list[JobRecord]:
        client = self.store.client
        exps = [e.experiment_id for e in client.search_experiments()]
        if not exps:
            return []
        runs = client.search_runs(
            exps, filter_string=(f"tags.`{MODEL_TAG}` = '1' and tags.`{DATASET_TAG}` = '{_q(dataset)}' "
                                 f"and tags.`{FAMILY_TAG}` = '{_q(model_family)}'"),
            order_by=["attributes.start_time DESC"], max_results=min(limit, self.max_runs))
        return [self._record(r, dataset, model_family) for r in runs]

    def _record(self, run, dataset: str, model_family: str) -> JobRecord:
        run_id = run.info.run_id
        plan = {}
        try:
            plan = json.loads(run.data.tags.get(PLAN_TAG, "{}"))
        except json.JSONDecodeError:
            self.problems.append(f"run {run_id}: tag {PLAN_TAG} is not JSON")
        rec = JobRecord(dataset=dataset, model_family=model_family, final_plan=plan,
                        finished_at=(run.info.end_time or run.info.start_time or 0) / 1000.0, run_id=run_id)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                path = self.store.client.download_artifacts(run_id, RECORD_FILE, tmp)
                data = json.loads(Path(path).read_text())
            rec.model = ThroughputModel.from_dict(data["throughput_model"])
            rec.memory = MemoryModel.from_dict(data["memory_model"]) if data.get("memory_model") else None
            rec.samples_per_s = data.get("samples_per_s")
            rec.peak_memory_bytes = data.get("peak_memory_bytes")
            rec.extra = dict(data.get("extra") or {})
            rec.final_plan = data.get("final_plan") or plan
        except (MlflowException, OSError, json.JSONDecodeError, KeyError, TypeError, ModelFitError) as e:
            self.problems.append(f"run {run_id}: {RECORD_FILE} missing or corrupt ({type(e).__name__}: {e}); "
                                 "using its final plan only")
        return rec


def _q(s: str) -> str:
    return s.replace("'", "\\'")


# ---------------------------------------------------------------------------------------------
# the daily pipeline's hooks (resources.policy == "dlrover")
# ---------------------------------------------------------------------------------------------
def plan_with_dlrover(store: TrackingStore, run_id: str, cfg, tables, total_rows: int):
    """Stage 1 for the plan task: MLflow history of runs with the same dataset preset and model family,
    within cfg.resources.dlrover's limits. Logs the events and the stage's state; returns
    (ResourcePlan, state for the train task)."""
    from recforge.elastic.optimizer.memory_model import GiB
    from recforge.elastic.optimizer.dlrover import optimizer_config, pipeline_limits, pipeline_plan
    from recforge.elastic.policy import ResourcePlan

    dl = cfg.resources.dlrover
    history = MlflowHistory(store)
    out = pipeline_plan(cfg.resources, dataset=cfg.dataset_preset, model_family=cfg.model.arch,
                        batch_size=cfg.train.batch_size, total_rows=int(total_rows), tables=tables,
                        embedding_dim=cfg.model.embedding_dim, history=history,
                        limits=pipeline_limits(dl.max_cpu, dl.max_workers),
                        memory_per_worker=dl.worker_memory_gib * GiB if dl.worker_memory_gib else None,
                        config=optimizer_config(dl), epochs=cfg.train.epochs)
    log_events(store, run_id, out["events"])
    store.log_dict(run_id, {**out["state"], "history_problems": history.problems}, "resource_model/stage1.json")
    store.set_tags(run_id, {"dlrover.stage1": out["events"][0].action if out["events"] else "none"})
    return ResourcePlan(out["workers"], out["threads_per_worker"]), out["state"]


def log_dlrover_run(store: TrackingStore, run_id: str, scaler, attempts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stages 2/3 as the elastic runtime executed them during the train task (`DLRoverScaler`): every
    event (executed or not, with why), the throughput measured at each plan, the relaunches, and this
    run's model with its measured points as history for tomorrow's stage 1 (registered, so it can be
    browsed and loaded by name)."""
    events = list(scaler.events)
    log_events(store, run_id, events)
    executed = [e for e in events if e.executed]
    by_plan = scaler.throughput_by_plan()
    metrics: dict[str, float] = {
        "dlrover.decisions": float(sum(1 for e in events if e.changes_plan or e.action == "replace_straggler")),
        "dlrover.executed": float(len(executed)),
        "dlrover.relaunches": float(sum(1 for a in attempts if a.get("outcome") == "rescaled")),
        "dlrover.final_workers": float(scaler.plan.workers),
    }
    for p in by_plan:
        metrics[f"dlrover.samples_per_s.w{p['workers']}t{p['threads_per_worker']}"] = p["samples_per_s"]
    if len(by_plan) >= 2 and by_plan[0]["samples_per_s"] > 0:
        metrics["dlrover.throughput_ratio_last_vs_first_plan"] = by_plan[-1]["samples_per_s"] / by_plan[0]["samples_per_s"]
    store.log_metrics(run_id, metrics)
    for i, m in enumerate(scaler.measured):  # the run's timeline, one point per profiler poll
        store.log_metrics(run_id, {"dlrover.samples_per_s": m["samples_per_s"], "dlrover.workers": float(m["workers"])}, step=i)
    summary: dict[str, Any] = {"executed": [e.to_dict() for e in executed], "throughput_by_plan": by_plan,
                               "attempts": list(attempts), "final_plan": scaler.plan.to_dict(),
                               "events": len(events), "model_status": scaler.runtime.model.status}
    summary["model_uri"] = _log_run_model(store, run_id, scaler, by_plan)
    store.log_dict(run_id, summary, "resource_model/stage23.json")
    return summary


def _log_run_model(store: TrackingStore, run_id: str, scaler, by_plan: list[dict[str, Any]]) -> str | None:
    """The runtime stage's model after the run, fitted (or the prior rescaled) on what the run measured."""
    online, job = scaler.runtime.model, scaler.policy.job
    if not online.samples:
        log.warning("DLRover: the run measured no throughput; no resource model logged for the history")
        return None
    try:
        online.refit()
    except ModelFitError as e:  # keep what the stage used; say so
        online.status = f"final refit failed ({e}); model as used during the run"
    if online.model is None:
        log.warning("DLRover: no resource model after the run (%s); none logged", online.status)
        return None
    from dataclasses import replace as _replace

    points = [Sample(_replace(scaler.plan, workers=p["workers"], cpu_per_worker=float(p["threads_per_worker"]))
                     .allocation(job.host_cores), float(p["samples_per_s"])) for p in by_plan]
    return log_resource_model(
        store, run_id, model=online.model, dataset=job.dataset, model_family=job.model_family,
        final_plan=scaler.plan.to_dict(), memory=scaler.policy.warm.memory, samples_per_s=by_plan[-1]["samples_per_s"],
        points=points, extra={"points": [{"allocation": s.allocation.to_dict(), "samples_per_s": s.samples_per_s}
                                         for s in points], "model_status": online.status}, register=True)
