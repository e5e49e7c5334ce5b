"""RAP's mapping in the daily pipeline: planned with the schedule, executed by the workers.

plan_resources  `plan_mapped_schedules`: the mapping MILP (recforge.rap.mapping.job_mapping) places every table for the
                job's world size; then each rank's two co-run jobs (its tables over the global batch, its dense and
                data-parallel features over its local batch) are scheduled (recforge.rap.planning.scheduler.
                mapped_rank_schedules) with every fused group timed at its job's rows. Written as one JSON
                (MAPPING_FILE: placements, per-rank schedules, imbalance before / after) next to the schedule.
worker          `worker_mapping`: the placements and this rank's jobs, when the file was planned for this world size
                (after a DLRover rescale to another size the job runs unmapped co-run and says so); shard_model takes
                the placements, `mapped_session` the jobs (recforge.rap.mapping.mapped_input skips the input all-to-all).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recforge.config import DatasetConfig
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.milp import Placement, split_rank_plan
from recforge.rap.mapping.job_mapping import COMPILE_METHOD  # the workers compile their rank plans as they were planned
from recforge.rap.planning.schedule import CorunSchedule

log = logging.getLogger(__name__)
MAPPING_FILE = "corun_mapping.json"
MAPPING_VERSION = 1


class MappingFileError(ValueError):
    """The mapping file is not one this version wrote, or does not fit the plan; the message names the key."""


@dataclass
class WorkerMapping:
    placements: dict[str, Placement]
    schedules: list[CorunSchedule]  # this rank's jobs, global first; empty when not executed (another world size)
    world_size: int
    batch_size: int

    @property
    def executed(self) -> bool:
        """False after a rescale to another world size: the tables keep their kinds (so the checkpoint's
        optimizer state loads), the workers co-run without the mapping."""
        return bool(self.schedules)


def placements_for_world(placements: dict[str, Placement], world_size: int, dim: int) -> dict[str, Placement]:
    """The same kind per table on `world_size` ranks (a rescaled job keeps fused vs dense kernels, whose optimizer
    states differ): table_wise on rank r -> r mod world_size; column_wise over every rank when the dimension splits
    as mapping.candidate_placements allows, else table_wise (also the fused kernel); data_parallel over every rank."""
    from recforge.rap.mapping.milp import candidate_placements

    out = {}
    for i, (table, p) in enumerate(sorted(placements.items())):
        if p.kind == "data_parallel":
            out[table] = Placement("data_parallel", tuple(range(world_size)))
        elif p.kind == "column_wise" and (cw := [c for c in candidate_placements(world_size, dim)
                                                  if c.kind == "column_wise"]):
            out[table] = cw[0]
        else:
            out[table] = Placement("table_wise", ((p.ranks[0] if p.kind == "table_wise" else i) % world_size,))
    return out


def write_mapping(path: Path, placements: dict[str, Placement], per_rank: list[list[CorunSchedule]], world_size: int,
                  batch_size: int, info: dict[str, Any]) -> None:
    from recforge.rap.mapping.job_mapping import placements_to_json

    doc = {"version": MAPPING_VERSION, "world_size": world_size, "batch_size": batch_size, "method": COMPILE_METHOD,
           "placements": json.loads(placements_to_json(placements)), "info": info,
           "ranks": [[json.loads(s.to_json()) for s in jobs] for jobs in per_rank]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def load_mapping(path: str | Path, world_size: int, rank: int, dim: int | None = None) -> WorkerMapping | None:
    """This rank's part of the mapping file. Planned for another world size: with the tables' embedding `dim`, the
    placements moved to this world size (placements_for_world) and no schedules (not executed), else None."""
    from recforge.rap.mapping.job_mapping import placements_from_json

    doc = json.loads(Path(path).read_text())
    for key in ("version", "world_size", "batch_size", "placements", "ranks"):
        if key not in doc:
            raise MappingFileError(f"mapping file {path}: key {key!r} missing")
    if doc["version"] != MAPPING_VERSION:
        raise MappingFileError(f"mapping file {path}: version {doc['version']}, this code reads {MAPPING_VERSION}")
    if doc["world_size"] != world_size:
        log.warning("RAP mapping %s was planned for %d workers, the job runs %d: co-run without the mapping "
                    "(tables keep their sharding kinds)", path, doc["world_size"], world_size)
        if dim is None:
            return None
        planned = placements_from_json(json.dumps(doc["placements"]))
        return WorkerMapping(placements_for_world(planned, world_size, dim), [], world_size, int(doc["batch_size"]))
    if len(doc["ranks"]) != world_size:
        raise MappingFileError(f"mapping file {path}: {len(doc['ranks'])} ranks of schedules for world size {world_size}")
    placements = placements_from_json(json.dumps(doc["placements"]))
    schedules = [CorunSchedule.from_json(json.dumps(s)) for s in doc["ranks"][rank]]
    return WorkerMapping(placements, schedules, world_size, int(doc["batch_size"]))


def mapped_jobs(plan: Plan, dataset: DatasetConfig, mapping: WorkerMapping, rank: int,
                batch_size: int | None = None) -> list[tuple[Any, CorunSchedule]]:
    """(executor, schedule) per job of `rank`, global first, each executor compiling its rank plan as planned.
    `batch_size`: the local batch the worker really runs (gradient accumulation splits the planned one): the
    schedules' `rows` follow it (their kernels do not depend on it; the planned rows stay in `planned_rows`)."""
    batch_size = batch_size or mapping.batch_size
    from recforge.preprocess.executors.fused import FusedExecutor

    local, global_ = split_rank_plan(plan, mapping.placements, rank)
    subs = {"global": global_, "local": local}
    jobs = []
    for sched in mapping.schedules:
        job = sched.meta.get("job")
        sub = subs.get(job)
        if sub is None:
            raise MappingFileError(f"mapping: rank {rank}'s schedule for job {job!r} has no plan under these placements")
        if sched.plan_name != sub.name:
            raise MappingFileError(f"mapping: rank {rank}'s {job} schedule is for plan {sched.plan_name!r}, "
                                   f"expected {sub.name!r}")
        rows = batch_size * (mapping.world_size if job == "global" else 1)
        if sched.meta.get("rows") != rows:  # a copy: the mapping's own schedules stay as planned
            sched = dataclasses.replace(sched, meta={**sched.meta, "planned_rows": sched.meta.get("rows"),
                                                     "rows": rows})
        jobs.append((FusedExecutor(sub, dataset, method=COMPILE_METHOD), sched))
    scheduled = {s.meta.get("job") for s in mapping.schedules}
    missing = [j for j, sub in subs.items() if sub is not None and j not in scheduled]
    if missing:
        raise MappingFileError(f"mapping: rank {rank} has no schedule for its {missing} job(s)")
    return jobs


def worker_mapping(spec, world_size: int, rank: int) -> WorkerMapping | None:
    """The mapping a worker runs under (spec.preprocessing 'corun' with a mapping file), else None."""
    if spec.preprocessing != "corun" or spec.corun_mapping_path is None:
        return None
    return load_mapping(spec.corun_mapping_path, world_size, rank, dim=spec.model.embedding_dim)


def mapped_session(spec, plan: Plan, sharded, mapping: WorkerMapping, device: torch.device, rank: int,
                   world_size: int, batch_size: int):
    """The worker's CorunSession under the mapping (its sharded model already placed by mapping.placements)."""
    from recforge.rap.runtime.session import CorunSession
    from recforge.rap.mapping.mapped_input import MappedInput

    mapped = MappedInput.install(sharded.model, rank, world_size)
    return CorunSession(plan, spec.dataset, None, sharded.model, device, threads=spec.corun_threads,
                        sharding=sharded.plan_summary(), jobs=mapped_jobs(plan, spec.dataset, mapping, rank, batch_size),
                        mapped=mapped)


def plan_mapped_schedules(cfg, plan: Plan, world_size: int, profile, out_path: Path) -> dict[str, Any]:
    """The job's mapping at planning time (see the module docstring): placements, every rank's job schedules, the
    simulator's predicted iteration time under them, written to `out_path`. Returns what plan_resources records."""
    from recforge.preprocess.executors.fused import FusedExecutor
    from recforge.pipelines.rap_corun import group_timer, simulated_iteration_ms
    from recforge.rap.mapping.job_mapping import plan_mapping, planner_placements
    from recforge.rap.planning.scheduler import mapped_rank_schedules

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
