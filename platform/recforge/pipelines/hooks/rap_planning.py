"""plan_resources' RAP part: the co-run schedule (and with corun.mapping, RAP's mapping) every worker runs, written
into the stage's outputs and logged to its MLflow run.

The job's stage profile is the one stored under corun.profile_dir for its model, tables, world size, batch size and
device; without one the job is profiled first (recforge.rap.profiling.profile_job), stored and logged.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.job_mapping import COMPILE_METHOD, plan_mapping, planner_placements
from recforge.rap.mapping.worker_mapping import MAPPING_FILE, write_mapping
from recforge.rap.planning.gantt import log_schedule
from recforge.rap.planning.job_schedule import plan_schedule, simulated_iteration_ms
from recforge.rap.planning.scheduler import mapped_rank_schedules
from recforge.rap.profiling.kernel_timer import group_timer
from recforge.rap.profiling.profile_job import ensure_profile, summary
from recforge.settings import recforge_home

SCHEDULE_FILE = "corun_schedule.json"


def plan_and_log_schedule(store, run_id: str, cfg, plan: Plan, world_size: int, writer,
                          manifest_dir: str | Path | None = None, trainer_threads: int = 1) -> dict[str, Any]:
    """plan_resources' part: the schedule into the stage's outputs (`writer`: its StageWriter) and its MLflow run.
    With `manifest_dir` (the training data) a job without a stored stage profile is profiled first
    (recforge.rap.profiling.profile_job: stored under corun.profile_dir and logged), so RAP's scheduler always runs."""
    profile_dir = cfg.corun.profile_dir or str(recforge_home() / "rap" / "profiles")
    profile, profile_info = None, None
    if manifest_dir is not None:
        profile, origin = ensure_profile(cfg, plan, world_size, manifest_dir, profile_dir, store, run_id,
                                         threads=trainer_threads)
        profile_info = summary(profile, origin)
    sched = plan_schedule(plan, cfg.dataset(), cfg.model, world_size, cfg.train.batch_size, cfg.corun.stage,
                          profile_dir, threads=cfg.corun.threads, profile=profile)
    (writer.tmp / SCHEDULE_FILE).write_text(sched.to_json())
    predicted = sched.meta.get("predicted_iteration_ms")
    if profile is not None:  # the Gantt chart over the profiled stages, next to the JSON
        log_schedule(sched, profile.stage_ms, profile.capacity_ms, store, run_id)
    else:
        store.log_dict(run_id, json.loads(sched.to_json()), "rap/schedule.json")
    metrics = {"rap_predicted_kernel_ms": sum(a.predicted_ms for a in sched.assignments)}
    if predicted is not None:
        metrics["rap_predicted_iteration_ms"] = predicted
        metrics |= {f"rap_simulated_ms.{m}": v for m, v in sched.meta["simulated_iteration_ms"].items()}
    mapping = None
    # RAP's mapping: placements + each rank's two co-run jobs (one worker has no input all-to-all to remove)
    if cfg.corun.mapping and profile is not None and world_size > 1:
        mapping = plan_and_log_mapping(store, run_id, cfg, plan, world_size, profile, writer)
        metrics |= {f"rap_mapping_{k}": float(mapping[k]) for k in ("imbalance_before", "imbalance_after",
                                                                    "predicted_iteration_ms") if mapping[k] is not None}
    store.log_metrics(run_id, metrics)
    return {"schedule_path": str(writer.final / SCHEDULE_FILE), "source": sched.meta.get("source"),
            "predicted_iteration_ms": predicted, "threads": cfg.corun.threads, "profile": profile_info,
            "mapping_path": mapping["mapping_path"] if mapping else None,
            "mapping": {k: v for k, v in mapping.items() if k != "mapping_path"} if mapping else None}


def plan_and_log_mapping(store, run_id: str, cfg, plan: Plan, world_size: int, profile, writer) -> dict[str, Any]:
    """plan_mapped_schedules into the stage's outputs; the file and rank 0's job schedules (JSON + Gantt over the
    profiled stages) into MLflow."""
    planned = plan_mapped_schedules(cfg, plan, world_size, profile, writer.tmp / MAPPING_FILE)
    store.log_artifact(run_id, str(writer.tmp / MAPPING_FILE), "rap")
    for job in planned.pop("per_rank")[0]:
        log_schedule(job, profile.stage_ms, job.meta["capacity_ms"], store, run_id,
                     name=f"rap/schedule_rank0_{job.meta['job']}")
    planned["mapping_path"] = str(writer.final / MAPPING_FILE)
    return planned


def plan_mapped_schedules(cfg, plan: Plan, world_size: int, profile, out_path: Path) -> dict[str, Any]:
    """The job's mapping at planning time, written to `out_path` (recforge.rap.mapping.worker_mapping's file).

    The mapping MILP (recforge.rap.mapping.job_mapping) places every table for the job's world size (or, with a fixed
    train.sharding, TorchRec's planner does); then each rank's two co-run jobs (its tables over the global batch, its
    dense and data-parallel features over its local batch) are scheduled with every fused group timed at its job's
    rows, and the simulator predicts the iteration time under these placements. Returns what plan_resources records.
    """
    dataset, batch = cfg.dataset(), cfg.train.batch_size
    full = FusedExecutor(plan, dataset, method=COMPILE_METHOD)
    timer = group_timer(full, dataset, batch)
    if cfg.train.sharding == "auto" and cfg.train.fused_embeddings:
        result = plan_mapping(plan, dataset, plan.tables(), cfg.model.embedding_dim, world_size, batch, profile, timer,
                              model=cfg.model, train=cfg.train, compiled=full.compiled)
        placements, how = result.placements, f"mapping MILP ({result.status})"
        info = {k: result.info.get(k) for k in ("before", "after", "before_error") if k in result.info}
    else:  # the user fixed the sharding type: torchrec's planner places the tables under it, the mapping follows
        placements = planner_placements(plan.tables(), cfg.model.embedding_dim, world_size, cfg.train, model=cfg.model,
                                        num_dense=len(plan.dense_features()))
        how, info = f"TorchRec planner under train.sharding={cfg.train.sharding!r}", {}

    def cost_of(compiled, rows: int):
        return group_timer(FusedExecutor(compiled.plan, dataset, compiled=compiled), dataset, rows)

    per_rank = [[s for _, s in mapped_rank_schedules(plan, placements, r, world_size, batch, profile.stage_ms,
                                                      profile.capacity_ms, cost_of, method=COMPILE_METHOD)]
                for r in range(world_size)]
    simulated = simulated_iteration_ms(plan, full.compiled, timer, profile, batch, placements=placements,
                                       world_size=world_size)
    for jobs in per_rank:
        for s in jobs:
            s.meta["predicted_iteration_ms"] = simulated["rap"]
            s.meta["predicted_by"] = "recforge.rap.planning.simulator, method rap, under these placements (all ranks)"
    info |= {"placed_by": how, "simulated_iteration_ms": simulated}
    write_mapping(out_path, placements, per_rank, world_size, batch, info)
    kinds = dict(Counter(p.kind for p in placements.values()))
    return {"mapping_path": str(out_path), "placed_by": how, "placement_kinds": kinds,
            "imbalance_before": (info.get("before") or {}).get("imbalance"),
            "imbalance_after": (info.get("after") or {}).get("imbalance"),
            "predicted_iteration_ms": simulated["rap"], "per_rank": per_rank}
