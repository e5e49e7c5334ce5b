"""A job's co-run schedule: RAP's scheduler over the job's stage profile and its timed fused kernels, with the
simulator's predicted iteration time. Without a profile every kernel runs whole in one stage."""
from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch

from recforge.config import DatasetConfig, ModelConfig
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.planning.compiler import CompiledPlan, FusedGroup
from recforge.preprocess.planning.plan import Plan
from recforge.rap.planning.schedule import CorunSchedule, group_features, restrict, whole_kernel_schedule
from recforge.rap.planning.scheduler import schedule
from recforge.rap.planning.simulator import KernelCost, RankStages, SimSetup, corun_thread_iteration_ms, simulate
from recforge.rap.profiling.kernel_timer import GroupTimer, batch_ms, group_timer
from recforge.rap.profiling.profiler import ProfileKey, ProfileMismatch, StageProfile
from recforge.rap.profiling.stages import STAGES
from recforge.train.placement import Placement

log = logging.getLogger(__name__)


def plan_schedule(plan: Plan, dataset: DatasetConfig, model: ModelConfig, world_size: int, batch_size: int,
                  stage: str, profile_dir: str | Path | None, threads: int = 1,
                  profile: StageProfile | None = None, executor: FusedExecutor | None = None) -> CorunSchedule:
    """The workers' schedule: RAP's scheduler over `profile` (or the one stored under `profile_dir` for this job),
    with the simulator's predicted iteration time in its meta; without a profile every kernel in `stage`.
    `executor`: the fused executor the co-run thread will run (its kernels are the ones timed, e.g. the torch /
    TorchScript fallback); default the plan's C++ fused executor."""
    if executor is not None and executor.plan is not plan:
        raise ValueError(f"plan_schedule: the executor runs plan {executor.plan.name!r}, not {plan.name!r}")
    if executor is None:
        executor = cast(FusedExecutor, make_executor("fused", plan, dataset))
    compiled: CompiledPlan = executor.compiled
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # time the kernels with the co-run thread's budget
    try:
        # a spread schedule runs group by group; an executor without the native kernels has no single pass
        grouped = (executor if not executor.native else
                   make_executor("fused", plan, dataset, compiled=compiled, single_pass=False))
        grouped_ms = batch_ms(grouped, dataset, batch_size)
        cost = batch_scaled(group_timer(executor, dataset, batch_size), compiled, grouped_ms)
        if profile is None:
            profile = stored_profile(profile_dir, model, plan, world_size, batch_size)
        if profile is not None:
            sched = schedule(compiled, profile.stage_ms, profile.capacity_ms, cost,
                             meta={"source": f"RAP scheduler over stage profile {profile.key.slug()}",
                                   "profile": profile.key.slug()})
            sched.meta["scheduler_iteration_ms"] = sum(profile.stage_ms.values()) + sched.meta["unhidden_ms"]
            simulated = simulated_iteration_ms(plan, compiled, cost, profile, batch_size)
            sched.meta["simulated_iteration_ms"] = simulated
            sched.meta["predicted_iteration_ms"] = simulated["rap"]
            sched.meta["predicted_by"] = ("recforge.rap.planning.simulator, method rap; every sparse feature "
                                          "data_parallel (each worker preprocesses its local batch, as the workers "
                                          "do); no input all-to-all term (not in a single-process profile)")
            if profile.key.device == "cpu":
                whole_ms = grouped_ms if grouped is executor else batch_ms(executor, dataset, batch_size)
                return cpu_schedule(sched, compiled, profile, whole_ms, {g.name: cost(g) for g in compiled.groups})
            return sched
        per_group = {g.name: cost(g) for g in compiled.groups}
        return whole_kernel_schedule(compiled, stage, per_group, meta={
            "source": f"no stored stage profile: every fused kernel whole in stage {stage!r}",
            "total_predicted_ms": sum(per_group.values())})
    finally:
        torch.set_num_threads(before)


def cpu_schedule(rap: CorunSchedule, compiled: CompiledPlan, profile: StageProfile, whole_ms: float,
                 per_group: dict[str, float]) -> CorunSchedule:
    """The schedule a CPU's co-run thread runs: the whole batch (`whole_ms`, one executor call: the single pass where
    the executor has one) from the step's first stage. The thread has a core of its own and its work runs on through
    the stages after the one it starts in, so it is hidden up to the summed capacity of that stage and every later
    one (simulator.corun_thread_iteration_ms), which the first stage maximizes: no start later in the step, and no
    packing of RAP's (`rap`: its per-stage model confines a stage's excess to that stage, and what spills past the
    last stage it takes is waited for), is predicted to hide more. RAP's schedule stays in the meta for comparison
    (`rap_schedule_*`), with the prediction of every start stage; the groups are predicted at their shares of
    `whole_ms` (by `per_group`, their grouped times)."""
    start = STAGES[0]
    # rounded as the simulator's predictions are (simulated_iteration_ms)
    starts = {s: round(corun_thread_iteration_ms(profile.stage_ms, profile.capacity_ms, whole_ms, s), 4)
              for s in STAGES}
    rap_ms = float(rap.meta["predicted_iteration_ms"])
    meta = {k: v for k, v in rap.meta.items() if k not in ("unhidden_ms", "predicted_iteration_ms", "source")}
    total = sum(per_group.values())
    shares = {g: (ms / total if total > 0 else 1.0 / len(per_group)) * whole_ms for g, ms in per_group.items()}
    return whole_kernel_schedule(compiled, start, shares, meta=meta | {
        "source": f"whole batch from {start} on the co-run thread (CPU); RAP's schedule ({rap.meta.get('source')}) "
                  "recorded beside it",
        "cpu_schedule": f"whole from {start}: the co-run thread runs on through the later stages",
        "predicted_iteration_ms": starts[start],
        "unhidden_ms": max(0.0, whole_ms - sum(profile.capacity_ms.values())),
        "predicted_by": "recforge.rap.planning.simulator.corun_thread_iteration_ms over the stage profile",
        "whole_start_iteration_ms": starts, "rap_schedule_iteration_ms": rap_ms,
        "rap_schedule_unhidden_ms": rap.meta.get("unhidden_ms"),
        "rap_schedule_stages": sorted({a.stage for a in rap.assignments}, key=STAGES.index)})


def batch_scaled(timer: GroupTimer, compiled: CompiledPlan, whole_ms: float) -> GroupTimer:
    """`timer` with every group's time scaled by whole_ms / the groups' sum when the executor's whole batch
    (`whole_ms`: its check, the groups' kernels and `finish`, which builds the dense matrix and the KJT) takes longer
    than its groups' kernels alone: the co-run thread pays all of it, and at small batches or under load the part
    outside the kernels is most of it (plan 0, 512 rows, a loaded 2-core CPU: 1.0 ms of kernels, 12 ms a batch)."""
    total = sum(timer(g) for g in compiled.groups)
    factor = whole_ms / total if total > 0 and whole_ms > total else 1.0
    return lambda group: timer(group) * factor


def measured_kernel_cost(compiled: CompiledPlan, timer: GroupTimer, batch_size: int) -> KernelCost:
    """simulator.KernelCost over the workers' fused executor: a group (or one node) of the simulator's own
    compilation is matched by layer, op, class and features to a part of `compiled`, timed by `timer`
    (group_timer's, at `batch_size` rows) and scaled linearly to the rows the simulator gives (RAP's scaling)."""
    owner = {(g.layer, g.op, g.cls, f): g for g in compiled.groups for f in group_features(compiled, g)}

    def cost(sim_compiled: CompiledPlan, group: FusedGroup, rows) -> float:
        feats = group_features(sim_compiled, group)
        found = {owner.get((group.layer, group.op, group.cls, f)) for f in feats}
        counterpart = found.pop() if len(found) == 1 else None
        if counterpart is None:
            raise ValueError(f"simulator group {group.name} (features {list(feats)}) has no single counterpart among "
                             f"the executor's fused groups {[g.name for g in compiled.groups]}")
        part = restrict(compiled, counterpart, feats)
        nodes = {n.id: n for n in sim_compiled.graph.nodes}
        scale = statistics.fmean(rows(nodes[n]) for n in group.nodes) / batch_size
        return timer(part) * scale

    return cost


def simulated_iteration_ms(plan: Plan, compiled: CompiledPlan, timer: GroupTimer, profile: StageProfile,
                           batch_size: int, placements: Mapping[str, Placement] | None = None,
                           world_size: int = 1) -> dict[str, float]:
    """recforge.rap.planning.simulator's iteration time of every method with `profile`'s stages on each of `world_size`
    workers; without `placements` every table data_parallel (each worker preprocesses its local batch)."""
    if placements is None:
        placements = {f: Placement("data_parallel", tuple(range(world_size))) for f in plan.sparse_features()}
    stages = RankStages(dict(profile.stage_ms), dict(profile.capacity_ms))
    setup = SimSetup(plan=plan, placements=placements, batch_size=batch_size, ranks=[stages] * world_size,
                     kernel_cost=measured_kernel_cost(compiled, timer, batch_size), compile_method=compiled.method)
    return {m: round(r.iteration_ms, 4) for m, r in simulate(setup).methods.items()}


def stored_profile(profile_dir: str | Path | None, model: ModelConfig, plan: Plan, world_size: int,
                   batch_size: int) -> StageProfile | None:
    """The stage profile stored under `profile_dir` for this job (model, tables, world size, batch size, this
    machine's device), else None."""
    if profile_dir is None:
        return None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return StageProfile.load(profile_dir, ProfileKey.of(model, plan.tables(), world_size, batch_size, device))
    except ProfileMismatch as e:
        log.info("co-run schedule without a stage profile: %s", e)
        return None
