"""The train task under DLRover-RM (resources.policy == "dlrover"): stages 2 and 3 run while the job trains.

The plan task left stage 1's plan and state (`plan_resources` outputs["dlrover"]); here they become a
`DLRoverScaler` that the elastic runtime consults while the workers train (see
recforge.elastic.master.dlrover_scaler for what it executes and how), and the run keeps a per-sample
ledger so the rows trained across relaunches can be audited. Afterwards every event (inputs,
prediction, reason, executed or not) and the run's resource model go to the train task's MLflow run.
A stage 1 state that cannot be read is a documented fallback: the job trains on the plan without
stages 2/3, and a "fallback" event says why.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recforge.elastic.backends.base import JobFailedError
from recforge.elastic.master.dlrover_scaler import DLRoverScaler, scaler_from_stage1
from recforge.elastic.optimizer.events import Event
from recforge.pipelines.hooks.resource_planning import log_dlrover_run
from recforge.pipelines.outputs import (
    DLRoverRun,
    ExecutedDecision,
    MemoryMeasurement,
    PlanMeasurement,
    PlanOutputs,
)
from recforge.tracking.resource_models import log_events
from recforge.train.result import WorkerResult
from recforge.train.spec import WorkerSpec

log = logging.getLogger(__name__)


def start(store, run_id: str, plan_out: PlanOutputs, cfg, spec: WorkerSpec,
          tmp: Path) -> tuple[DLRoverScaler | None, WorkerSpec]:
    """The scaler for run_training_job (None under the static policy) and `spec`, with the ledger under stages 2/3."""
    state = plan_out.dlrover
    if cfg.resources.policy != "dlrover" or not state:
        return None, spec
    try:
        scaler = scaler_from_stage1(state, cfg.resources.dlrover, memory_action="accumulate")  # local backend
    except (ValueError, TypeError) as e:
        log.warning("DLRover stages 2/3 off for this run: %s", e)
        log_events(store, run_id, [Event("runtime", "fallback", f"{e}: training on the plan task's plan without "
                                         "stages 2/3", plan_before=state.get("plan"))])
        return None, spec
    spec = spec.model_copy(update={"recovery": spec.recovery.model_copy(update={"ledger_dir": tmp / "ledger"})})
    store.log_params(run_id, {"dlrover": cfg.resources.dlrover.model_dump(mode="json")})
    return scaler, spec


def finish(store, run_id: str, scaler, attempts: Sequence[dict[str, Any]],
           worker_dir: str | Path | None = None) -> DLRoverRun | None:
    """Log what stages 2/3 decided and executed during the run, predicted vs measured throughput and memory
    (the workers' result in `worker_dir`, when they wrote one); the summary for the task's outputs."""
    if scaler is None:
        return None
    worker = None
    if worker_dir is not None:
        try:
            worker = WorkerResult.load(worker_dir)
        except (FileNotFoundError, ValueError) as e:
            log.warning("DLRover: no worker result for predicted vs measured (%s)", e)
    summary = log_dlrover_run(store, run_id, scaler, attempts, worker)
    mem = summary["memory"]
    return DLRoverRun(
        throughput_by_plan=summary["throughput_by_plan"], final_plan=summary["final_plan"], events=summary["events"],
        model_uri=summary["model_uri"],
        executed=[_decision(e) for e in summary["executed"]], decisions=[_decision(e) for e in summary["decisions"]],
        plans=[PlanMeasurement.model_validate({k: v for k, v in p.items() if k != "source"})
               for p in summary["plans"]],
        memory=MemoryMeasurement(predicted_peak_bytes=mem["predicted_peak_bytes"],
                                 measured_peak_bytes=mem["measured_peak_bytes"], predicted_by=mem["predicted_by"],
                                 fitted=mem["fitted"]))


def _decision(d: dict[str, Any]) -> ExecutedDecision:
    return ExecutedDecision(stage=d["stage"], action=d["action"], reason=d["reason"], executed=d["executed"])


def logging_failures(store, run_id: str, scaler, run_job):
    """`run_job` (run_training_job) that, when the job fails, still logs what stages 2/3 did first."""
    if scaler is None:
        return run_job

    def run(*args, **kwargs):
        try:
            return run_job(*args, **kwargs)
        except JobFailedError as e:
            finish(store, run_id, scaler, getattr(e, "attempts", []))
            raise
    return run
