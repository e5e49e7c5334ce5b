"""RAP's mapping file, between planning and the workers: the placements of every table and each rank's co-run
jobs (global first), planned for one world size (MAPPING_FILE, written by the plan stage). A worker reads its
part (load_mapping): shard_model takes the placements, the co-run session the jobs (mapped_jobs). After a
rescale to another world size the tables keep their kinds and the job co-runs without the mapping.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recforge.config import DatasetConfig
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.job_mapping import (  # the workers compile their rank plans as they were planned
    COMPILE_METHOD,
    placements_from_json,
    placements_to_json,
)
from recforge.rap.mapping.milp import Placement, candidate_placements, split_rank_plan
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
    doc = {"version": MAPPING_VERSION, "world_size": world_size, "batch_size": batch_size, "method": COMPILE_METHOD,
           "placements": json.loads(placements_to_json(placements)), "info": info,
           "ranks": [[json.loads(s.to_json()) for s in jobs] for jobs in per_rank]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def load_mapping(path: str | Path, world_size: int, rank: int, dim: int | None = None) -> WorkerMapping | None:
    """This rank's part of the mapping file. Planned for another world size: with the tables' embedding `dim`, the
    placements moved to this world size (placements_for_world) and no schedules (not executed), else None."""
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
        raise MappingFileError(f"mapping file {path}: {len(doc['ranks'])} ranks of schedules for "
                               f"world size {world_size}")
    placements = placements_from_json(json.dumps(doc["placements"]))
    schedules = [CorunSchedule.from_json(json.dumps(s)) for s in doc["ranks"][rank]]
    return WorkerMapping(placements, schedules, world_size, int(doc["batch_size"]))


def mapped_jobs(plan: Plan, dataset: DatasetConfig, mapping: WorkerMapping, rank: int,
                batch_size: int | None = None) -> list[tuple[Any, CorunSchedule]]:
    """(executor, schedule) per job of `rank`, global first, each executor compiling its rank plan as planned.
    `batch_size`: the local batch the worker really runs (gradient accumulation splits the planned one): the
    schedules' `rows` follow it (their kernels do not depend on it; the planned rows stay in `planned_rows`)."""
    batch_size = batch_size or mapping.batch_size
    local, global_ = split_rank_plan(plan, mapping.placements, rank)
    subs: dict[str | None, Plan | None] = {"global": global_, "local": local}
    jobs = []
    for sched in mapping.schedules:
        job = sched.meta.get("job")
        sub = subs.get(job)
        if sub is None:
            raise MappingFileError(f"mapping: rank {rank}'s schedule for job {job!r} has no plan under "
                                   "these placements")
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
