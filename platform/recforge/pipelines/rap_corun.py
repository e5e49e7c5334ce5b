"""The daily pipeline's RAP co-run (and its offline baseline): the schedule at planning time, the session in the
worker, the MLflow record.

plan_resources  `plan_and_log_schedule`: the job's stage profile (recforge.rap.profiling.profiler.StageProfile under
                corun.profile_dir, keyed by model, tables, world size, batch size, device); without a stored one
                the job is profiled first (recforge.rap.profiling.profile_job: a short single-process run of the real model
                on the first training batches), stored and logged. `plan_schedule`: each fused group timed on a
                synthetic batch of the worker's batch size (the fused executor itself, so the prediction is of
                the kernels that will run); RAP's scheduler packs them into the stages' spare capacity; the
                predicted iteration time is recforge.rap.planning.simulator's (method rap, every method in the meta).
                Called without a profile and none stored: every kernel whole in `corun.stage`, no prediction.
worker          `start_session`: the CorunSession over the sharded model (checks run before the first step).
offline         `preprocess_offline` (train task, before the job) and the worker's `epoch_source`.
train           `log_corun`: the schedule (JSON + Gantt PNG over the profiled stages, a second one over the stage
                times measured while co-running), predicted vs measured iteration time and their ratio, the
                kernels' time and the trainer's wait, as MLflow metrics.
"""
from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from recforge.config import DatasetConfig, ModelConfig
from recforge.preprocess.planning.compiler import CompiledPlan, FusedGroup
from recforge.preprocess.planning.plan import Plan
from recforge.rap.planning.schedule import CorunSchedule, whole_kernel_schedule
from recforge.rap.profiling.stages import STAGES

log = logging.getLogger(__name__)
SCHEDULE_FILE = "corun_schedule.json"


def group_timer(executor, dataset: DatasetConfig, rows: int, repeats: int = 5, seed: int = 0):
    """ms of a fused group or part (FusedGroup) of `executor`'s plan over `rows` synthetic rows (median of
    `repeats`; its inputs come from one full run of the plan)."""
    from recforge.preprocess.synth import random_raw_batch

    raw = random_raw_batch(dataset, rows, seed=seed)
    vals: dict = {}
    for gi, g in enumerate(executor.compiled.groups):
        executor.run_group(gi, g, raw, vals)
    keys: dict[tuple[int, ...], int] = {}

    def ms(group: FusedGroup) -> float:
        key = keys.setdefault(group.nodes, len(executor.compiled.groups) + len(keys))  # a cache slot per part
        executor.run_group(key, group, raw, vals)  # warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            executor.run_group(key, group, raw, vals)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return ms


def plan_schedule(plan: Plan, dataset: DatasetConfig, model: ModelConfig, world_size: int, batch_size: int,
                  stage: str, profile_dir: str | Path | None, threads: int = 1, profile=None) -> CorunSchedule:
    """The workers' schedule: RAP's scheduler over `profile` (or the one stored under `profile_dir` for this job),
    with the simulator's predicted iteration time in its meta; without a profile every kernel in `stage`."""
    from recforge.preprocess.executor import make_executor

    executor = make_executor("fused", plan, dataset)
    compiled: CompiledPlan = executor.compiled
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # time the kernels with the co-run thread's budget
    try:
        cost = group_timer(executor, dataset, batch_size)
        if profile is None:
            profile = _stored_profile(profile_dir, model, plan, world_size, batch_size)
        if profile is not None:
            from recforge.rap.planning.scheduler import schedule

            sched = schedule(compiled, profile.stage_ms, profile.capacity_ms, cost,
                             meta={"source": f"RAP scheduler over stage profile {profile.key.slug()}",
                                   "profile": profile.key.slug()})
            sched.meta["scheduler_iteration_ms"] = sum(profile.stage_ms.values()) + sched.meta["unhidden_ms"]
            simulated = simulated_iteration_ms(plan, compiled, cost, profile, batch_size)
            sched.meta["simulated_iteration_ms"] = simulated
            sched.meta["predicted_iteration_ms"] = simulated["rap"]
            sched.meta["predicted_by"] = ("recforge.rap.planning.simulator, method rap; every sparse feature data_parallel "
                                          "(each worker preprocesses its local batch, as the workers do); no input "
                                          "all-to-all term (not in a single-process profile)")
            return sched
        per_group = {g.name: cost(g) for g in compiled.groups}
        return whole_kernel_schedule(compiled, stage, per_group, meta={
            "source": f"no stored stage profile: every fused kernel whole in stage {stage!r}",
            "total_predicted_ms": sum(per_group.values())})
    finally:
        torch.set_num_threads(before)


def measured_kernel_cost(compiled: CompiledPlan, timer, batch_size: int):
    """simulator.KernelCost over the workers' fused executor: a group (or one node) of the simulator's own
    compilation is matched by layer, op, class and features to a part of `compiled`, timed by `timer`
    (group_timer's, at `batch_size` rows) and scaled linearly to the rows the simulator gives (RAP's scaling)."""
    from recforge.rap.planning.schedule import group_features, restrict

    owner = {(g.layer, g.op, g.cls, f): g for g in compiled.groups for f in group_features(compiled, g)}

    def cost(sim_compiled: CompiledPlan, group: FusedGroup, rows) -> float:
        feats = group_features(sim_compiled, group)
        found = {owner.get((group.layer, group.op, group.cls, f)) for f in feats}
        if None in found or len(found) != 1:
            raise ValueError(f"simulator group {group.name} (features {list(feats)}) has no single counterpart among "
                             f"the executor's fused groups {[g.name for g in compiled.groups]}")
        part = restrict(compiled, found.pop(), feats)
        nodes = {n.id: n for n in sim_compiled.graph.nodes}
        scale = statistics.fmean(rows(nodes[n]) for n in group.nodes) / batch_size
        return timer(part) * scale

    return cost


def simulated_iteration_ms(plan: Plan, compiled: CompiledPlan, timer, profile, batch_size: int,
                           placements=None, world_size: int = 1) -> dict[str, float]:
    """recforge.rap.planning.simulator's iteration time of every method with `profile`'s stages on each of `world_size`
    workers; without `placements` every table data_parallel (each worker preprocesses its local batch)."""
    from recforge.rap.mapping.milp import Placement
    from recforge.rap.profiling.profiler import rank_stages
    from recforge.rap.planning.simulator import SimSetup, simulate

    if placements is None:
        placements = {f: Placement("data_parallel", tuple(range(world_size))) for f in plan.sparse_features()}
    setup = SimSetup(plan=plan, placements=placements, batch_size=batch_size, ranks=[rank_stages(profile)] * world_size,
                     kernel_cost=measured_kernel_cost(compiled, timer, batch_size), compile_method=compiled.method)
    return {m: round(r.iteration_ms, 4) for m, r in simulate(setup).methods.items()}


def _stored_profile(profile_dir, model: ModelConfig, plan: Plan, world_size: int, batch_size: int):
    if profile_dir is None:
        return None
    from recforge.rap.profiling.profiler import ProfileKey, ProfileMismatch, StageProfile

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return StageProfile.load(profile_dir, ProfileKey.of(model, plan.tables(), world_size, batch_size, device))
    except ProfileMismatch as e:
        log.info("co-run schedule without a stage profile: %s", e)
        return None


def load_schedule(path: str | Path | None, compiled: CompiledPlan, stage: str = "mlp_bwd") -> CorunSchedule:
    """The planned schedule, or (no path) every kernel whole in `stage`."""
    if path is None:
        return whole_kernel_schedule(compiled, stage, meta={"source": f"worker default: every kernel in {stage!r}"})
    return CorunSchedule.from_json(Path(path).read_text())


def start_session(spec, plan: Plan, sharded, device: torch.device, mapping=None, rank: int = 0, world_size: int = 1,
                  batch_size: int | None = None):
    """The worker's CorunSession for spec.preprocessing == 'corun', else None; with `mapping`
    (recforge.rap.mapping.worker_mapping.WorkerMapping) RAP's mapped co-run over local batches of `batch_size` rows."""
    if spec.preprocessing != "corun":
        return None
    if mapping is not None and mapping.executed:
        from recforge.rap.mapping.worker_mapping import mapped_session

        return mapped_session(spec, plan, sharded, mapping, device, rank, world_size,
                              batch_size or mapping.batch_size)
    from recforge.preprocess.executor import make_executor
    from recforge.rap.runtime.session import CorunSession

    executor = make_executor("fused", plan, spec.dataset)
    schedule = load_schedule(spec.corun_schedule_path, executor.compiled)
    return CorunSession(plan, spec.dataset, schedule, sharded.model, device, threads=spec.corun_threads,
                        sharding=sharded.plan_summary(), executor=executor)


def epoch_source(spec, corun, client, executor, batch_size: int, device: torch.device, ledger=None):
    """One epoch's batches by spec.preprocessing: inline (TaskBatches), corun (the session's), offline (the rows
    preprocessed before training, spec.preprocessed_dir)."""
    if corun is not None:
        return corun.batches(client, spec.manifest_dir, spec.dataset, batch_size, device, ledger)
    if spec.preprocessing == "offline":
        from recforge.rap.runtime.offline import OfflineTaskBatches

        return OfflineTaskBatches(client, spec.preprocessed_dir, spec.dataset, batch_size, device, ledger=ledger)
    from recforge.train.batches import TaskBatches

    return TaskBatches(client, spec.manifest_dir, spec.dataset, executor, batch_size, device, ledger=ledger)


def preprocess_offline(store, run_id: str, manifest_dir: str, plan_path: str, dataset: DatasetConfig, executor: str,
                       out_dir: Path) -> dict[str, Any]:
    """The train task's first step with preprocessing: offline: the whole manifest preprocessed, timed, logged."""
    from recforge.rap.runtime.offline import preprocess_manifest

    t0 = time.perf_counter()
    index = preprocess_manifest(manifest_dir, Plan.load(plan_path), dataset, out_dir, executor)
    seconds = time.perf_counter() - t0
    rows = sum(index["shard_rows"])
    store.log_metrics(run_id, {"offline_preprocess_s": seconds, "offline_preprocess_rows_per_s": rows / max(seconds, 1e-9)})
    return {"rows": rows, "seconds": seconds}


def drop_offline_data(store, run_id: str, preprocessed_dir: Path) -> int:
    """After the job trained: delete the offline-preprocessed rows (a second copy of the training data that the
    stage's outputs would otherwise keep); their size is logged as offline_preprocessed_bytes."""
    import shutil

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
    from recforge.rap.planning.gantt import log_schedule

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


def plan_and_log_schedule(store, run_id: str, cfg, plan: Plan, world_size: int, writer,
                          manifest_dir: str | Path | None = None, trainer_threads: int = 1) -> dict[str, Any]:
    """plan_resources' part: the schedule into the stage's outputs (`writer`: its StageWriter) and its MLflow run.
    With `manifest_dir` (the training data) a job without a stored stage profile is profiled first
    (recforge.rap.profiling.profile_job: stored under corun.profile_dir and logged), so RAP's scheduler always runs."""
    from recforge.settings import recforge_home

    profile_dir = cfg.corun.profile_dir or str(recforge_home() / "rap" / "profiles")
    profile, profile_info = None, None
    if manifest_dir is not None:
        from recforge.rap.profiling.profile_job import ensure_profile, summary

        profile, origin = ensure_profile(cfg, plan, world_size, manifest_dir, profile_dir, store, run_id,
                                         threads=trainer_threads)
        profile_info = summary(profile, origin)
    sched = plan_schedule(plan, cfg.dataset(), cfg.model, world_size, cfg.train.batch_size, cfg.corun.stage,
                          profile_dir, threads=cfg.corun.threads, profile=profile)
    (writer.tmp / SCHEDULE_FILE).write_text(sched.to_json())
    predicted = sched.meta.get("predicted_iteration_ms")
    if profile is not None:  # the Gantt chart over the profiled stages, next to the JSON
        from recforge.rap.planning.gantt import log_schedule

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
    """recforge.rap.mapping.worker_mapping.plan_mapped_schedules into the stage's outputs; the file and rank 0's job
    schedules (JSON + Gantt over the profiled stages) into MLflow."""
    from recforge.rap.mapping.worker_mapping import MAPPING_FILE, plan_mapped_schedules
    from recforge.rap.planning.gantt import log_schedule

    planned = plan_mapped_schedules(cfg, plan, world_size, profile, writer.tmp / MAPPING_FILE)
    store.log_artifact(run_id, str(writer.tmp / MAPPING_FILE), "rap")
    for job in planned.pop("per_rank")[0]:
        log_schedule(job, profile.stage_ms, job.meta["capacity_ms"], store, run_id,
                     name=f"rap/schedule_rank0_{job.meta['job']}")
    planned["mapping_path"] = str(writer.final / MAPPING_FILE)
    return planned
