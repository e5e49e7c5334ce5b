"""plan_resources' RAP part: `preprocessing: auto` (co-run or inline, by RAP's predicted iteration times), the
co-run schedule (and with corun.mapping, RAP's mapping) every worker runs, written into the stage's outputs and
logged to its MLflow run.

The job's stage profile is the one stored under corun.profile_dir for its model, tables, world size, batch size and
device; without one, `auto` first bounds what co-run could save (a training step on one rank against the
preprocessing) and chooses inline unprofiled when that is within the margin, else the job is profiled
(recforge.rap.profiling.profile_job), stored and logged. Design: docs/rap.md#preprocessing-auto.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.job_mapping import COMPILE_METHOD, plan_mapping, planner_placements
from recforge.rap.mapping.worker_mapping import MAPPING_FILE, write_mapping
from recforge.rap.planning.choice import (
    CORUN_MARGIN,
    ModeChoice,
    ModePredictions,
    StepBound,
    choose_by_bound,
    choose_mode,
)
from recforge.rap.planning.gantt import gantt_tasks, log_schedule
from recforge.rap.planning.job_schedule import plan_schedule, simulated_iteration_ms
from recforge.rap.planning.schedule import CorunSchedule
from recforge.rap.planning.scheduler import mapped_rank_schedules
from recforge.rap.profiling.kernel_timer import batch_ms, group_timer
from recforge.rap.profiling.profile_job import ensure_profile, job_step, single_rank_group, summary
from recforge.rap.profiling.profiler import ProfileKey, ProfileMismatch, StageProfile
from recforge.rap.profiling.stages import STAGES
from recforge.settings import recforge_home

log = logging.getLogger(__name__)

SCHEDULE_FILE = "corun_schedule.json"
BOUND_STEPS = 5  # timed training steps of the lower bound, after one warm-up step


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Time kernels with the thread budget of the thread that will run them (OpenMP's count is per thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class CorunCandidate:
    """The co-run as planned for the job, before anything about it is written or logged (but the profile)."""

    schedule: CorunSchedule
    profile: StageProfile | None
    profile_info: dict[str, Any] | None
    mapping: dict[str, Any] | None  # plan_mapped_schedules', its file written; per_rank: each rank's job schedules
    predicted_corun_ms: float | None
    seconds: float

    def predictions(self, inline_prep_ms: float) -> ModePredictions:
        if self.profile is None or self.predicted_corun_ms is None:
            raise ValueError("co-run predictions need the job's stage profile (none was stored or measured)")
        ranks = self.mapping["per_rank"] if self.mapping else [[self.schedule]]
        kernels = max(sum(a.predicted_ms for s in jobs for a in s.assignments) for jobs in ranks)
        return ModePredictions(train_ms=sum(self.profile.stage_ms.values()), inline_prep_ms=inline_prep_ms,
                               corun_ms=self.predicted_corun_ms, corun_kernel_ms=kernels,
                               capacity_ms=sum(self.profile.capacity_ms.values()), mapping=self.mapping is not None)


@dataclass
class PreprocessingPlan:
    """What plan_resources records about preprocessing: the choice, and with corun its plan and Gantt."""

    choice: ModeChoice
    corun: dict[str, Any] | None  # CorunPlan's fields
    rap_schedule: dict[str, Any] | None  # the run page's Gantt (PlanOutputs.rap_schedule)
    seconds: dict[str, float]  # where the decision's time went


def plan_preprocessing(store, run_id: str, cfg, plan: Plan, world_size: int, writer, manifest_dir: str | Path,
                       trainer_threads: int = 1, margin: float = CORUN_MARGIN) -> PreprocessingPlan:
    """cfg.preprocessing auto or corun: time inline preprocessing; `auto` without a stored profile first bounds what
    co-run could save (train_step_lower_bound_ms) and chooses inline unprofiled when it is within `margin`; else
    profile the job (stored profiles reused), plan RAP's co-run, choose (recforge.rap.planning.choice) and record
    it; the co-run's files and MLflow records only when the workers will co-run."""
    t0 = time.perf_counter()
    with torch_threads(trainer_threads):  # inline preprocessing runs in the trainer's thread
        inline_prep = batch_ms(make_executor(cfg.preprocess_executor, plan, cfg.dataset()), cfg.dataset(),
                               cfg.train.batch_size)
    seconds = {"inline_timing_s": time.perf_counter() - t0}
    bound = None
    if cfg.preprocessing == "auto" and stored_job_profile(cfg, plan, world_size) is None:
        t_bound = time.perf_counter()
        bound = StepBound(train_step_lower_bound_ms(cfg, plan, manifest_dir, trainer_threads), inline_prep)
        seconds["train_bound_s"] = time.perf_counter() - t_bound
        choice = choose_by_bound("auto", bound, margin)
        if choice is not None:  # co-run cannot pay here: nothing to profile or plan
            seconds |= {"profile_s": 0.0, "corun_plan_s": 0.0}
            return finish_choice(store, run_id, choice, None, bound, PreprocessingPlan(choice, None, None, seconds), t0)
    cand = corun_candidate(store, run_id, cfg, plan, world_size, writer, manifest_dir, trainer_threads)
    info = cand.profile_info or {}
    seconds |= {"profile_s": (info.get("seconds") or 0.0) if info.get("origin") == "profiled" else 0.0,
                "corun_plan_s": cand.seconds}
    predictions = cand.predictions(inline_prep) if cand.profile is not None else None
    choice = choose_mode(cfg.preprocessing, predictions, margin)
    corun = rap_schedule = None
    if choice.mode == "corun":
        corun = record_corun(store, run_id, cfg, cand, writer)
        rap_schedule = planned_gantt(cand)
    elif cand.mapping is not None:  # planned for nothing: the workers run inline
        Path(writer.tmp / MAPPING_FILE).unlink(missing_ok=True)
    return finish_choice(store, run_id, choice, predictions, bound,
                         PreprocessingPlan(choice, corun, rap_schedule, seconds), t0)


def finish_choice(store, run_id: str, choice: ModeChoice, predictions: ModePredictions | None,
                  bound: StepBound | None, planned: PreprocessingPlan, t0: float) -> PreprocessingPlan:
    """Log the choice and where the decision's time went (since `t0`); returns `planned`."""
    log_choice(store, run_id, choice, predictions, bound)
    seconds = planned.seconds
    seconds["decision_s"] = time.perf_counter() - t0
    store.log_metrics(run_id, {f"preprocessing_{k}": round(v, 3) for k, v in seconds.items()})
    log.info("preprocessing %s -> %s (%s) in %.1f s", choice.requested, choice.mode, choice.reason,
             seconds["decision_s"])
    return planned


def stored_job_profile(cfg, plan: Plan, world_size: int) -> StageProfile | None:
    """The stage profile stored for the job (as ensure_profile finds it), else None."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    key = ProfileKey.of(cfg.model, plan.tables(), world_size, cfg.train.batch_size, device)
    try:
        return StageProfile.load(profile_root(cfg), key)
    except ProfileMismatch:
        return None


def train_step_lower_bound_ms(cfg, plan: Plan, manifest_dir: str | Path, threads: int = 1) -> float:
    """A lower bound (ms) of the job's profiled training stages summed, without profiling: the job's model sharded
    onto one rank in this process (every table local; each rank of the job does at least this work per step, plus
    the collectives and the contention of the other ranks), trained on its first batches in the trainer's thread
    budget; per stage the fastest of BOUND_STEPS steps after a warm-up, summed (at most the stage medians' sum)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch_threads(threads), single_rank_group("nccl" if device.type == "cuda" else "gloo"), \
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # this process's RNG unmoved
        tracker, step, _ = job_step(cfg, plan, cfg.dataset(), manifest_dir, 1, device)
        try:
            for _ in range(1 + BOUND_STEPS):
                step()
        finally:
            tracker.detach()
    steps = tracker.steps[1:]
    return sum(min(t.ms[s] for t in steps) for s in STAGES)


def profile_root(cfg) -> str:
    return cfg.corun.profile_dir or str(recforge_home() / "rap" / "profiles")


def log_choice(store, run_id: str, choice: ModeChoice, predictions: ModePredictions | None = None,
               bound: StepBound | None = None) -> None:
    """The choice into the plan task's MLflow run: the request as a param; the mode, what predicted it (the profile
    or the bound) and the reason as tags, since they come from measurements and a retried task may measure its way
    to another choice (params are immutable); both predictions (lower bounds when bound) and, where measured, the
    bound as metrics."""
    store.log_params(run_id, {"preprocessing_requested": choice.requested})
    tags = {"preprocessing_mode": choice.mode, "preprocessing_reason": choice.reason}
    if choice.predicted_inline_ms is not None:
        tags["preprocessing_predicted_by"] = "bound" if choice.bound else "profile"
    store.set_tags(run_id, tags)
    metrics = {"preprocessing_predicted_inline_ms": choice.predicted_inline_ms,
               "preprocessing_predicted_corun_ms": choice.predicted_corun_ms}
    if predictions is not None:
        metrics |= {"preprocessing_predicted_train_ms": predictions.train_ms,
                    "preprocessing_predicted_inline_prep_ms": predictions.inline_prep_ms}
    if bound is not None:
        metrics |= {"preprocessing_train_bound_ms": bound.train_lb_ms,
                    "preprocessing_predicted_inline_prep_ms": bound.inline_prep_ms,
                    "preprocessing_corun_saving_bound": bound.max_corun_saving}
    store.log_metrics(run_id, {k: float(v) for k, v in metrics.items() if v is not None})


def corun_candidate(store, run_id: str, cfg, plan: Plan, world_size: int, writer,
                    manifest_dir: str | Path | None = None, trainer_threads: int = 1) -> CorunCandidate:
    """RAP's co-run for the job: the stage profile (stored, else measured, stored and logged), the schedule with
    its predicted iteration time, and with corun.mapping at 2+ workers the mapping (its file into writer.tmp)."""
    profile_dir = profile_root(cfg)
    profile, profile_info = None, None
    if manifest_dir is not None:
        profile, origin = ensure_profile(cfg, plan, world_size, manifest_dir, profile_dir, store, run_id,
                                         threads=trainer_threads)
        profile_info = summary(profile, origin)
    t0 = time.perf_counter()
    sched = plan_schedule(plan, cfg.dataset(), cfg.model, world_size, cfg.train.batch_size, cfg.corun.stage,
                          profile_dir, threads=cfg.corun.threads, profile=profile)
    mapping = None
    # RAP's mapping: placements + each rank's two co-run jobs (one worker has no input all-to-all to remove)
    if cfg.corun.mapping and profile is not None and world_size > 1:
        with torch_threads(cfg.corun.threads):  # the co-run thread's budget, as plan_schedule times with
            mapping = plan_mapped_schedules(cfg, plan, world_size, profile, writer.tmp / MAPPING_FILE)
        mapping["mapping_path"] = str(writer.final / MAPPING_FILE)
    predicted = mapping["predicted_iteration_ms"] if mapping else sched.meta.get("predicted_iteration_ms")
    return CorunCandidate(sched, profile, profile_info, mapping, predicted, time.perf_counter() - t0)


def record_corun(store, run_id: str, cfg, cand: CorunCandidate, writer) -> dict[str, Any]:
    """The co-run the workers run: the schedule file into the stage's outputs, schedule(s) + Gantt + predictions
    into its MLflow run; returns CorunPlan's fields."""
    sched, profile, mapping = cand.schedule, cand.profile, cand.mapping
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
    if mapping is not None and profile is not None:
        store.log_artifact(run_id, str(writer.tmp / MAPPING_FILE), "rap")
        for job in mapping["per_rank"][0]:
            log_schedule(job, profile.stage_ms, job.meta["capacity_ms"], store, run_id,
                         name=f"rap/schedule_rank0_{job.meta['job']}")
        metrics |= {f"rap_mapping_{k}": float(mapping[k]) for k in ("imbalance_before", "imbalance_after",
                                                                    "predicted_iteration_ms") if mapping[k] is not None}
    store.log_metrics(run_id, metrics)
    return {"schedule_path": str(writer.final / SCHEDULE_FILE), "source": sched.meta.get("source"),
            "predicted_iteration_ms": predicted, "threads": cfg.corun.threads, "profile": cand.profile_info,
            "mapping_path": mapping["mapping_path"] if mapping else None,
            "mapping": {k: v for k, v in mapping.items() if k not in ("mapping_path", "per_rank")} if mapping
            else None}


def planned_gantt(cand: CorunCandidate) -> dict[str, Any] | None:
    """PlanOutputs.rap_schedule: rank 0's planned co-run over the profiled stages (None without a profile)."""
    if cand.profile is None:
        return None
    if cand.mapping is None:
        return gantt_tasks([("", cand.schedule)], cand.profile.stage_ms, cand.profile.capacity_ms)
    jobs = [(s.meta.get("job", str(i)), s) for i, s in enumerate(cand.mapping["per_rank"][0])]
    return gantt_tasks(jobs, cand.profile.stage_ms, cand.profile.capacity_ms)


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
