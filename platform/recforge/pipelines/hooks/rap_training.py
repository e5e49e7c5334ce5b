"""The train stage's RAP part: the offline baseline's preprocessing before the job (and its cleanup after), and what
ran into the stage's MLflow run: the preprocessing mode and why, predicted vs measured step time, the mapping's
imbalance, and the workers' co-run record (schedule, Gantt charts, measured timeline for the run page)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from recforge.config import DatasetConfig
from recforge.pipelines.outputs import PlanOutputs
from recforge.preprocess.planning.plan import Plan
from recforge.rap.planning.gantt import log_schedule, measured_gantt
from recforge.rap.planning.schedule import CorunSchedule
from recforge.rap.profiling.stages import STAGES
from recforge.rap.runtime.offline import preprocess_manifest
from recforge.train.result import WorkerResult


def preprocess_offline(store, run_id: str, manifest_dir: str, plan_path: str, dataset: DatasetConfig, executor: str,
                       out_dir: Path) -> dict[str, Any]:
    """The train task's first step with preprocessing: offline: the whole manifest preprocessed, timed, logged."""
    t0 = time.perf_counter()
    index = preprocess_manifest(manifest_dir, Plan.load(plan_path), dataset, out_dir, executor)
    seconds = time.perf_counter() - t0
    rows = sum(index["shard_rows"])
    store.log_metrics(run_id, {"offline_preprocess_s": seconds,
                               "offline_preprocess_rows_per_s": rows / max(seconds, 1e-9)})
    return {"rows": rows, "seconds": seconds}


def drop_offline_data(store, run_id: str, preprocessed_dir: Path) -> int:
    """After the job trained: delete the offline-preprocessed rows (a second copy of the training data that the
    stage's outputs would otherwise keep); their size is logged as offline_preprocessed_bytes."""
    size = sum(f.stat().st_size for f in Path(preprocessed_dir).rglob("*") if f.is_file())
    shutil.rmtree(preprocessed_dir)
    store.log_metrics(run_id, {"offline_preprocessed_bytes": float(size)})
    return size


def log_corun(store, run_id: str, summary: dict[str, Any]) -> dict[str, float]:
    """A worker's co-run summary (CorunSession.summary, in result.json): schedule JSON + Gantt PNG and the
    predicted / measured metrics into the train stage's MLflow run."""
    schedule = CorunSchedule.from_json(json.dumps(summary["schedule"]))
    metrics = {k: float(summary[k]) for k in ("measured_iteration_ms", "predicted_iteration_ms", "kernel_ms",
                                             "wait_ms", "predicted_kernel_ms") if summary.get(k) is not None}
    metrics = {f"rap_{k}": v for k, v in metrics.items()}
    metrics |= {f"rap_stage_ms.{s}": float(v) for s, v in summary.get("measured_stage_ms", {}).items()}
    if set(summary.get("measured_stage_ms") or {}) >= set(STAGES):  # the part of an iteration the stages cover
        metrics["rap_measured_stage_sum_ms"] = sum(float(summary["measured_stage_ms"][s]) for s in STAGES)
        if "rap_wait_ms" in metrics:  # what the prediction covers: the five stages plus the trainer's wait (unhidden)
            metrics["rap_measured_stage_iteration_ms"] = metrics["rap_measured_stage_sum_ms"] + metrics["rap_wait_ms"]
    predicted, measured = metrics.get("rap_predicted_iteration_ms"), metrics.get("rap_measured_iteration_ms")
    if predicted and measured:
        metrics["rap_predicted_over_measured_iteration"] = predicted / measured
    if predicted and metrics.get("rap_measured_stage_iteration_ms"):
        metrics["rap_predicted_over_measured_stages"] = predicted / metrics["rap_measured_stage_iteration_ms"]
    store.log_metrics(run_id, metrics)
    profiled = schedule.meta.get("stage_ms") or {}
    stage_ms = summary.get("measured_stage_ms") or {}
    if set(profiled) >= set(STAGES):  # the scheduler's view: profiled stages and capacities
        log_schedule(schedule, profiled, schedule.meta["capacity_ms"], store, run_id)
        if set(stage_ms) >= set(STAGES):  # the same kernels over the stage times measured while co-running
            log_schedule(schedule, stage_ms, schedule.meta["capacity_ms"], store, run_id, name="rap/schedule_measured")
    elif set(stage_ms) >= set(STAGES):
        # no profile (fallback schedule): capacity drawn as the whole stage (a spare core on CPU)
        log_schedule(schedule, stage_ms, stage_ms, store, run_id)
    else:
        store.log_dict(run_id, json.loads(schedule.to_json()), "rap/schedule.json")
    for job, doc in ((summary.get("mapped") or {}).get("schedules") or {}).items():  # each job of the mapped co-run
        job_schedule = CorunSchedule.from_json(json.dumps(doc))
        if set(stage_ms) >= set(STAGES) and "stage_capacity_ms" in job_schedule.meta:
            log_schedule(job_schedule, stage_ms, job_schedule.meta["stage_capacity_ms"], store, run_id,
                         name=f"rap/schedule_{job}_measured")
        else:
            store.log_dict(run_id, doc, f"rap/schedule_{job}.json")
    store.log_dict(run_id, {k: v for k, v in summary.items() if k != "schedule"}, "rap/corun_summary.json")
    return metrics


def measured_step_ms(worker: WorkerResult) -> float | None:
    """Mean training-loop time per (micro-)batch of the last worker generation, in ms (None before any step)."""
    steps = worker.steps - (worker.resumed_from.step if worker.resumed_from is not None else 0)
    if steps <= 0 or worker.train_wall_s <= 0:
        return None
    return worker.train_wall_s * 1e3 / (steps * worker.grad_accumulation)


def log_preprocessing(store, run_id: str, plan: PlanOutputs, worker: WorkerResult) -> dict[str, Any] | None:
    """What preprocessing ran, into the train run: mode and request (params), why (tag), the chosen mode's
    predicted step time against the measured one, both predictions, the mapping's imbalance before/after
    (metrics), and with co-running the workers' record (log_corun). Returns TrainOutputs.rap_schedule: the
    measured co-run timeline (None when the workers did not co-run)."""
    choice = plan.preprocessing
    if choice is not None:
        store.log_params(run_id, {"preprocessing_mode": choice.mode, "preprocessing_requested": choice.requested})
        store.set_tags(run_id, {"preprocessing_reason": choice.reason})
    metrics: dict[str, float | None] = {}
    if choice is not None and choice.bound:  # lower bounds, not predictions: no predicted/measured ratio
        metrics |= {"preprocessing_inline_lower_bound_ms": choice.predicted_inline_ms,
                    "preprocessing_corun_lower_bound_ms": choice.predicted_corun_ms}
    elif choice is not None:
        metrics |= {"preprocessing_predicted_inline_ms": choice.predicted_inline_ms,
                    "preprocessing_predicted_corun_ms": choice.predicted_corun_ms,
                    "preprocessing_predicted_step_ms": {"inline": choice.predicted_inline_ms,
                                                        "corun": choice.predicted_corun_ms}.get(choice.mode)}
    measured = measured_step_ms(worker)
    metrics["preprocessing_measured_step_ms"] = measured
    predicted = metrics.get("preprocessing_predicted_step_ms")
    if predicted and measured:
        metrics["preprocessing_predicted_over_measured"] = predicted / measured
    mapping = plan.corun.mapping if plan.corun is not None else None
    if mapping is not None:
        metrics |= {"rap_mapping_imbalance_before": mapping.imbalance_before,
                    "rap_mapping_imbalance_after": mapping.imbalance_after}
    store.log_metrics(run_id, {k: float(v) for k, v in metrics.items() if v is not None})
    if not worker.rap:
        return None
    log_corun(store, run_id, worker.rap)
    return measured_gantt(worker.rap)
