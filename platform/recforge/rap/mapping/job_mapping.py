"""A pipeline job's RAP mapping: the mapping MILP (recforge.rap.mapping.milp) over the job's measured costs, compared
with TorchRec's planner, and the placements as JSON.

    result = plan_mapping(plan, dataset, tables, embedding_dim, world_size, batch_size, profile, timer, model=cfg.model)
    result.placements                       # {table: Placement}: give them to shard_model(placements=...)
    result.info["before"], ["after"]        # per-rank step times and imbalance of the planner's / the MILP's placement

The MILP's costs (TableLoad / MappingCosts) come from the job's stage profile and its timed fused groups; how each
one is derived, and where it over- or understates: docs/rap.md. Without a profile the result keeps the planner's
placement (status says so).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, cast

import torch
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from recforge.config import DatasetConfig, ModelConfig, TrainConfig
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.planning.compiler import CompiledPlan, CompileMethod, compile_plan
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.milp import (
    MappingCosts,
    MappingError,
    MappingResult,
    Placement,
    RankTimes,
    TableLoad,
    candidate_placements,
    check_tables,
    evaluate,
    from_torchrec,
    placement_load,
    solve,
)
from recforge.rap.planning.schedule import restrict, split_units
from recforge.rap.profiling.kernel_timer import GroupTimer, group_timer
from recforge.rap.profiling.profiler import ProfileKey, StageProfile
from recforge.train.model import EBC_PATH, build_dlrm, embedding_configs
from recforge.train.sharding import make_planner, plan_summary

KINDS = ("table_wise", "column_wise", "data_parallel")
# the workers' executors compile the plan this way (recforge.rap.mapping.worker_mapping)
COMPILE_METHOD: CompileMethod = "greedy"


# ------------------------------------------------------------------ JSON


def placements_to_json(placements: Mapping[str, Placement]) -> str:
    """{table: {"kind": ..., "ranks": [...]}}, tables in the given order."""
    return json.dumps({t: {"kind": p.kind, "ranks": [int(r) for r in p.ranks]} for t, p in placements.items()},
                      indent=1)


def placements_from_json(text: str) -> dict[str, Placement]:
    """The inverse of placements_to_json; MappingError naming the table and key that is malformed."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise MappingError(f"placements: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise MappingError(f"placements: expected an object of tables, got {type(data).__name__}")
    out = {}
    for table, entry in data.items():
        if not isinstance(entry, dict):
            raise MappingError(f"placements: table {table!r}: expected an object with 'kind' and 'ranks', "
                               f"got {entry!r}")
        unknown = sorted(set(entry) - {"kind", "ranks"})
        if unknown:
            raise MappingError(f"placements: table {table!r}: unknown keys {unknown} (expected 'kind', 'ranks')")
        for key in ("kind", "ranks"):
            if key not in entry:
                raise MappingError(f"placements: table {table!r}: key {key!r} missing")
        kind, ranks = entry["kind"], entry["ranks"]
        if kind not in KINDS:
            raise MappingError(f"placements: table {table!r}: 'kind' {kind!r} is not one of {list(KINDS)}")
        if (not isinstance(ranks, list) or not ranks
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)):
            raise MappingError(f"placements: table {table!r}: 'ranks' must be a non-empty list of ranks >= 0, "
                               f"got {ranks!r}")
        if kind == "table_wise" and len(ranks) != 1:
            raise MappingError(f"placements: table {table!r}: 'ranks' of a table_wise table is one rank, got {ranks}")
        out[table] = Placement(kind, tuple(ranks))
    return out


# ------------------------------------------------------------------ preprocessing costs


def prep_costs(compiled: CompiledPlan, timer: GroupTimer) -> tuple[dict[str, float], float]:
    """(marginal ms of each sparse feature's chain at the timer's rows, ms every rank spends regardless of the
    placement: dense groups and the sparse groups' launch cost). See the module doc."""
    per_feature: dict[str, float] = {f: 0.0 for f in compiled.plan.sparse_features()}
    fixed = 0.0
    for g in compiled.groups:
        whole = timer(g)
        if g.cls == "dense":
            fixed += whole
            continue
        units = split_units(compiled, g)
        if len(units) == 1:
            launch, alone = 0.0, [whole]
        else:
            alone = [timer(restrict(compiled, g, u)) for u in units]
            # t(k units) = launch + sum of their marginals: from the parts alone and the whole
            launch = min(max((sum(alone) - whole) / (len(units) - 1), 0.0), min(alone))
        fixed += launch
        for unit, t in zip(units, alone, strict=True):
            for f in unit:
                per_feature[f] += (t - launch) / len(unit)
    return per_feature, fixed


def table_loads(plan: Plan, tables: Sequence[tuple[str, int]], embedding_dim: int, per_feature_ms: Mapping[str, float],
                world_size: int) -> list[TableLoad]:
    """One mapping.TableLoad per table; ids per sample = the feature's row width (of a scalar source column)."""
    widths = {f.name: float(f.width) for f in plan.features}
    return [TableLoad(name, int(rows), int(embedding_dim), per_feature_ms[name] * world_size, per_feature_ms[name],
                      pooling=widths[name]) for name, rows in tables]


# ------------------------------------------------------------------ training costs


def dense_parameter_count(model: ModelConfig, tables: Sequence[tuple[str, int]], num_dense: int) -> int:
    """Parameters of the model outside its embedding tables (built on the meta device: nothing allocated)."""
    m = build_dlrm(model, tables, max(num_dense, 1), device="meta")
    return sum(p.numel() for n, p in m.named_parameters() if not n.startswith(EBC_PATH + "."))


def check_profile(profile: StageProfile, world_size: int, batch_size: int, model: ModelConfig | None,
                  tables: Sequence[tuple[str, int]]) -> None:
    """ProfileMismatch unless `profile` was made for this world size, batch size and (given) model and tables."""
    digest = profile.key.model
    if model is not None:
        digest = ProfileKey.of(model, tables, world_size, batch_size, profile.key.device).model
    profile.check(ProfileKey(digest, world_size, batch_size, profile.key.device))


def mapping_costs(profile: StageProfile, loads: Sequence[TableLoad], world_size: int, batch_size: int,
                  dense_prep_ms: float, dense_params: int | None, *, allreduce_ms_per_value: float | None = None,
                  memory_values: float = math.inf, state_factor: float = 1.0,
                  table_overhead_ms: float = 0.0) -> MappingCosts:
    """mapping.MappingCosts from a stage profile (see the module doc for each estimate)."""
    stage = profile.stage_ms
    emb_ms = stage["emb_fwd"] + stage["emb_bwd"]
    looked_up = batch_size * sum(t.pooling * t.dim for t in loads)
    if allreduce_ms_per_value is None:
        if not dense_params:
            raise MappingError("the data_parallel all-reduce cost needs the model's dense parameter count: pass "
                               "model= or allreduce_ms_per_value=")
        allreduce_ms_per_value = stage["allreduce"] / dense_params
    return MappingCosts(
        world_size=world_size, batch_size=batch_size, base_ms=max(sum(stage.values()) - emb_ms, 0.0),
        lookup_ms_per_value=emb_ms / max(looked_up, 1.0), allreduce_ms_per_value=allreduce_ms_per_value,
        dense_prep_ms=dense_prep_ms, capacity_ms=[sum(profile.capacity_ms.values())] * world_size,
        memory_values=memory_values, table_overhead_ms=table_overhead_ms, state_factor=state_factor)


def check_memory(loads: Sequence[TableLoad], costs: MappingCosts) -> None:
    """MappingError naming every table that fits no rank under any of its placements, however the others go."""
    too_big = []
    for t in loads:
        need = min(float(placement_load(t, p, costs).memory.max())
                   for p in candidate_placements(costs.world_size, t.dim))
        if need > costs.memory_values:
            too_big.append(f"{t.name!r} ({t.rows} rows x {t.dim}: at least {need:.4g} values on a rank)")
    if too_big:
        raise MappingError(f"tables that fit no rank's memory ({costs.memory_values:.4g} embedding values per rank): "
                           + ", ".join(too_big))


# ------------------------------------------------------------------ torchrec's planner (the "before")


def planner_placements(tables: Sequence[tuple[str, int]], embedding_dim: int, world_size: int, train: TrainConfig,
                       model: ModelConfig | None = None, num_dense: int = 1,
                       device_type: str = "cpu") -> dict[str, Placement]:
    """The placements TorchRec's planner picks for the job, as shard_model would ask it (a meta-device model:
    nothing allocated). Without `model`, the embedding collection alone is planned."""
    if model is not None:
        module = build_dlrm(model, tables, max(num_dense, 1), device="meta")
    else:
        module = torch.nn.Module()
        holder = module
        *parents, leaf = EBC_PATH.split(".")
        for name in parents:
            child = torch.nn.Module()
            holder.add_module(name, child)
            holder = child
        holder.add_module(leaf, EmbeddingBagCollection(tables=embedding_configs(tables, embedding_dim), device="meta"))
    planner = make_planner(train, [t for t, _ in tables], world_size, device_type)
    return from_torchrec(plan_summary(planner.plan(module, [EmbeddingBagCollectionSharder()])))


# ------------------------------------------------------------------ the job's mapping


def _times(times: RankTimes, placements: Mapping[str, Placement]) -> dict[str, Any]:
    return {"placements": json.loads(placements_to_json(placements)), **asdict(times),
            "max_step_ms": max(times.step_ms), "imbalance": times.imbalance}


def plan_mapping(plan: Plan, dataset: DatasetConfig, tables: Sequence[tuple[str, int]], embedding_dim: int,
                 world_size: int, batch_size: int, profile: StageProfile | None, timer: GroupTimer | None, *,
                 model: ModelConfig | None = None, train: TrainConfig | None = None,
                 compiled: CompiledPlan | None = None, memory_bytes_per_rank: float = math.inf,
                 bytes_per_value: float = 4.0, state_factor: float = 1.0, table_overhead_ms: float = 0.0,
                 allreduce_ms_per_value: float | None = None, compare_planner: bool = True,
                 time_limit_s: float = 30.0) -> MappingResult:
    """The job's table placements: mapping.solve over the costs described in the module doc.

    timer: ms of a fused group of `compiled` at `batch_size` rows (recforge.rap.profiling.kernel_timer.group_timer);
    None times the fused executor on synthetic rows of `dataset` here. compiled: the compilation the timer's groups come
    from (default: the plan compiled as the workers compile it). model: checks the profile's model digest, counts
    the dense parameters (all-reduce estimate) and is what the planner plans. train: its sharding must leave the
    choice open (sharding 'auto', fused_embeddings), as the MILP chooses among all three kinds.

    info: 'before' (TorchRec's planner) and 'after' (the MILP) with per-rank times, max step and imbalance,
    'costs', 'tables', 'prep' (per-feature marginal ms, fixed ms). MappingError names the table that does not fit
    memory, or a table missing from the plan; ProfileMismatch for a profile of another job.
    """
    train = train or TrainConfig()
    if train.sharding != "auto" or not train.fused_embeddings:
        raise MappingError(f"the mapping chooses each table's sharding, so it needs train.sharding='auto' and "
                           f"fused_embeddings=true (got {train.sharding!r}, {train.fused_embeddings})")
    if model is not None and model.embedding_dim != embedding_dim:
        raise MappingError(f"embedding_dim {embedding_dim} is not the model's ({model.embedding_dim})")
    if world_size < 1 or batch_size < 1:
        raise MappingError(f"world_size and batch_size must be >= 1, got {world_size}, {batch_size}")
    check_tables(plan, [t for t, _ in tables])
    if profile is not None:
        check_profile(profile, world_size, batch_size, model, tables)
    if timer is None:
        executor = cast(FusedExecutor, make_executor("fused", plan, dataset, method=COMPILE_METHOD, compiled=compiled))
        compiled, timer = executor.compiled, group_timer(executor, dataset, batch_size)
    elif compiled is None:
        compiled = compile_plan(plan, method=COMPILE_METHOD)
    per_feature, fixed_ms = prep_costs(compiled, timer)
    loads = table_loads(plan, tables, embedding_dim, per_feature, world_size)
    num_dense = len(plan.dense_features())
    device_type = profile.key.device if profile is not None else "cpu"

    before: dict[str, Placement] | None = None
    planner_error = None
    if profile is not None and compare_planner:
        try:
            before = planner_placements(tables, embedding_dim, world_size, train, model, num_dense, device_type)
        except Exception as e:  # the comparison is a report: a planner that finds no plan does not stop the MILP
            planner_error = f"{type(e).__name__}: {e}"
    if profile is None:  # nothing to trade preprocessing against: keep the planner's placement
        before = planner_placements(tables, embedding_dim, world_size, train, model, num_dense, device_type)
        costs = MappingCosts(world_size=world_size, batch_size=batch_size, base_ms=0.0, lookup_ms_per_value=0.0,
                             allreduce_ms_per_value=0.0, dense_prep_ms=fixed_ms, capacity_ms=[0.0] * world_size,
                             memory_values=memory_bytes_per_rank / bytes_per_value,
                             table_overhead_ms=table_overhead_ms, state_factor=state_factor)
        times = evaluate(loads, before, costs)
        result = MappingResult(dict(before), times, 0.0, "no stage profile: TorchRec planner's placement kept", 0)
    else:
        dense_params = dense_parameter_count(model, tables, num_dense) if model is not None else None
        costs = mapping_costs(profile, loads, world_size, batch_size, fixed_ms, dense_params,
                              allreduce_ms_per_value=allreduce_ms_per_value,
                              memory_values=memory_bytes_per_rank / bytes_per_value, state_factor=state_factor,
                              table_overhead_ms=table_overhead_ms)
        check_memory(loads, costs)
        result = solve(loads, costs, time_limit_s=time_limit_s)
    result.info |= {
        "after": _times(result.times, result.placements),
        "costs": {**asdict(costs), "capacity_ms": list(costs.capacity_ms)},
        "tables": [asdict(t) for t in loads],
        "prep": {"per_feature_ms": per_feature, "fixed_ms": fixed_ms, "rows": batch_size},
        "profile": profile.key.slug() if profile is not None else None,
    }
    if before is not None:
        result.info["before"] = _times(evaluate(loads, before, costs), before)
    if planner_error is not None:
        result.info["before_error"] = planner_error
    return result
