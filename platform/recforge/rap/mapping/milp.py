"""Where tables live and where their preprocessing runs (RAP §3.1), chosen jointly by a MILP (beyond the artifact).

A sparse feature is preprocessed on the rank that owns its table, over the global batch, so training skips the
input all-to-all of ids; dense features are preprocessed data-parallel. A MILP (HiGHS) picks one TorchRec
placement per table to minimize the slowest rank's predicted step. Design: docs/rap.md#the-mapping-milp; its
costs: docs/rap.md#where-the-mapping-milps-costs-come-from.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from recforge.preprocess.planning.graph import Node, OpGraph
from recforge.preprocess.planning.plan import Plan
from recforge.train.placement import Placement  # the MILP's choice is the input of TorchRec sharding (recforge.train)


class MappingError(ValueError):
    """Tables and plan features disagree, or no placement fits; the message names the table / feature."""


@dataclass(frozen=True)
class TableLoad:
    name: str  # table == sparse feature name
    rows: int
    dim: int
    prep_ms_global: float  # its preprocessing chain over the global batch (world * B rows)
    prep_ms_local: float  # over the local batch (B rows)
    pooling: float = 1.0  # ids per sample


@dataclass(frozen=True)
class MappingCosts:
    world_size: int
    batch_size: int  # local
    base_ms: float  # the dense part of a step (MLPs, dense all-reduce), every rank
    lookup_ms_per_value: float  # per looked-up embedding value (sample x id x column), forward + backward + a2a
    allreduce_ms_per_value: float  # per table value all-reduced each step (data_parallel gradients)
    dense_prep_ms: float  # dense features + kernel launches on every rank
    capacity_ms: Sequence[float]  # per rank: spare capacity hiding preprocessing (sum over stages)
    memory_values: float = float("inf")  # per rank: embedding values (rows x dim) it may hold
    table_overhead_ms: float = 0.0  # per table per rank holding a shard / replica (kernel, all-to-all split)
    state_factor: float = 1.0  # memory per value incl. optimizer state, relative to the weight


def candidate_placements(world_size: int, dim: int) -> list[Placement]:
    out = [Placement("table_wise", (r,)) for r in range(world_size)]
    if world_size > 1 and dim % world_size == 0 and (dim // world_size) % 4 == 0:
        out.append(Placement("column_wise", tuple(range(world_size))))
    out.append(Placement("data_parallel", tuple(range(world_size))))
    return out


@dataclass(frozen=True)
class _Load:
    train: np.ndarray  # per rank ms
    prep: np.ndarray
    memory: np.ndarray  # values


def placement_load(t: TableLoad, p: Placement, c: MappingCosts) -> _Load:
    w, b = c.world_size, c.batch_size
    train, prep, mem = np.zeros(w), np.zeros(w), np.zeros(w)
    if p.kind == "table_wise":
        r = p.ranks[0]
        train[r] = c.lookup_ms_per_value * w * b * t.pooling * t.dim + c.table_overhead_ms
        prep[r] = t.prep_ms_global
        mem[r] = t.rows * t.dim
    elif p.kind == "column_wise":
        k = len(p.ranks)
        for r in p.ranks:
            train[r] = c.lookup_ms_per_value * w * b * t.pooling * t.dim / k + c.table_overhead_ms
            prep[r] = t.prep_ms_global
            mem[r] = t.rows * t.dim / k
    else:
        train[:] = (c.lookup_ms_per_value * b * t.pooling * t.dim + c.allreduce_ms_per_value * t.rows * t.dim
                    + c.table_overhead_ms)
        prep[:] = t.prep_ms_local
        mem[:] = t.rows * t.dim
    return _Load(train, prep, mem * c.state_factor)


@dataclass
class RankTimes:
    train_ms: list[float]
    prep_ms: list[float]
    unhidden_ms: list[float]
    step_ms: list[float]

    @property
    def imbalance(self) -> float:
        """max / mean - 1 of the per-rank step times."""
        return max(self.step_ms) / float(np.mean(self.step_ms)) - 1.0


def evaluate(tables: Sequence[TableLoad], placements: Mapping[str, Placement], costs: MappingCosts) -> RankTimes:
    w = costs.world_size
    train, prep = np.full(w, costs.base_ms), np.full(w, costs.dense_prep_ms)
    for t in tables:
        load = placement_load(t, placements[t.name], costs)
        train, prep = train + load.train, prep + load.prep
    unhidden = np.maximum(0.0, prep - np.asarray(costs.capacity_ms))
    return RankTimes(train.tolist(), prep.tolist(), unhidden.tolist(), (train + unhidden).tolist())


@dataclass
class MappingResult:
    placements: dict[str, Placement]
    times: RankTimes
    solve_s: float
    status: str
    candidates: int
    info: dict = field(default_factory=dict)


def solve(tables: Sequence[TableLoad], costs: MappingCosts, time_limit_s: float = 30.0) -> MappingResult:
    """MILP: x[t,p] one placement per table; u_r >= prep_r - capacity_r, u_r >= 0; z >= train_r + u_r; memory;
    minimize z (+ 1e-6 * sum u: among equal maxima, hide more)."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # lazy: ~0.5 s of a rank's start-up
    from scipy.sparse import lil_matrix  # lazy: with scipy.optimize, off the ranks' start-up

    w = costs.world_size
    if len(costs.capacity_ms) != w:
        raise MappingError(f"capacity_ms has {len(costs.capacity_ms)} ranks, world_size is {w}")
    cands = [(t, p) for t in tables for p in candidate_placements(w, t.dim)]
    loads = [placement_load(t, p, costs) for t, p in cands]
    nx = len(cands)
    iu, iz = nx, nx + w  # u_0..u_{w-1}, then z
    n = nx + w + 1
    obj = np.zeros(n)
    obj[iz] = 1.0
    obj[iu:iz] = 1e-6
    lo: list[float] = []
    hi: list[float] = []
    a = lil_matrix((len(tables) + 3 * w, n))
    row = 0
    for t in tables:  # one placement each
        for j, (tj, _) in enumerate(cands):
            if tj is t:
                a[row, j] = 1
        lo.append(1)
        hi.append(1)
        row += 1
    for r in range(w):
        # prep_r - u_r <= capacity_r - dense_prep
        for j, ld in enumerate(loads):
            if ld.prep[r]:
                a[row, j] = ld.prep[r]
        a[row, iu + r] = -1
        lo.append(-np.inf)
        hi.append(costs.capacity_ms[r] - costs.dense_prep_ms)
        row += 1
        # train_r + u_r - z <= -base
        for j, ld in enumerate(loads):
            if ld.train[r]:
                a[row, j] = ld.train[r]
        a[row, iu + r] = 1
        a[row, iz] = -1
        lo.append(-np.inf)
        hi.append(-costs.base_ms)
        row += 1
        for j, ld in enumerate(loads):
            if ld.memory[r]:
                a[row, j] = ld.memory[r]
        lo.append(-np.inf)
        hi.append(costs.memory_values)
        row += 1
    integrality = np.zeros(n)
    integrality[:nx] = 1
    ub = np.full(n, np.inf)
    ub[:nx] = 1
    t0 = time.perf_counter()
    res = milp(obj, constraints=LinearConstraint(a.tocsr(), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(n), ub), options={"time_limit": time_limit_s})
    elapsed = time.perf_counter() - t0
    if res.x is None:
        raise MappingError(f"no table placement fits (HiGHS: {res.message}); check memory_values "
                           f"({costs.memory_values}) against the tables")
    chosen = {t.name: p for (t, p), x in zip(cands, res.x[:nx], strict=True) if x > 0.5}
    return MappingResult(chosen, evaluate(tables, chosen, costs), elapsed, res.message, nx,
                         info={"objective_ms": float(res.x[iz])})


def brute_force(tables: Sequence[TableLoad], costs: MappingCosts) -> tuple[float, dict[str, Placement]]:
    """Reference for tiny instances: every combination, memory-feasible, smallest max step time."""
    best: tuple[float, dict[str, Placement]] = (float("inf"), {})
    options = [candidate_placements(costs.world_size, t.dim) for t in tables]
    for combo in itertools.product(*options):
        chosen = {t.name: p for t, p in zip(tables, combo, strict=True)}
        mem = sum((placement_load(t, p, costs).memory for t, p in zip(tables, combo, strict=True)),
                  np.zeros(costs.world_size))
        if (mem > costs.memory_values + 1e-9).any():
            continue
        value = max(evaluate(tables, chosen, costs).step_ms)
        if value < best[0] - 1e-12:
            best = (value, chosen)
    return best


# ------------------------------------------------------------------ plans per rank


def check_tables(plan: Plan, table_names: Sequence[str]) -> None:
    """MappingError unless the plan's sparse features and the sharding plan's tables are the same set."""
    feats, tables = set(plan.sparse_features()), set(table_names)
    if feats - tables:
        raise MappingError(f"plan {plan.name!r}: sparse features {sorted(feats - tables)} have no table in the "
                           f"sharding plan (tables: {sorted(tables)})")
    if tables - feats:
        raise MappingError(f"sharding plan tables {sorted(tables - feats)} are not sparse features of "
                           f"plan {plan.name!r}")


def rank_features(plan: Plan, placements: Mapping[str, Placement], rank: int) -> tuple[list[str], list[str]]:
    """(features preprocessed over the local batch, over the global batch) on `rank`: dense features and
    data_parallel tables local; table_wise / column_wise tables it holds, global."""
    check_tables(plan, list(placements))
    local, global_ = list(plan.dense_features()), []
    for f in plan.sparse_features():
        p = placements[f]
        if p.kind == "data_parallel":
            local.append(f)
        elif rank in p.ranks:
            global_.append(f)
    return local, global_


def rank_plan(plan: Plan, placements: Mapping[str, Placement], rank: int) -> Plan:
    """The features `rank` preprocesses, as a plan named '<plan>@rank<r>' (its co-run schedule names it)."""
    local, global_ = rank_features(plan, placements, rank)
    keep = set(local) | set(global_)
    return Plan(name=f"{plan.name}@rank{rank}", features=[f for f in plan.features if f.name in keep])


def split_rank_plan(plan: Plan, placements: Mapping[str, Placement], rank: int) -> tuple[Plan | None, Plan | None]:
    """(local plan, global plan) of `rank`: the features it preprocesses over its local batch (dense features and
    data_parallel tables) and over the global batch (table_wise / column_wise tables it holds), each in plan order
    and named '<plan>@rank<r>.local' / '<plan>@rank<r>.global'; None where there is no such feature. The two run
    over different rows, so each is its own fused plan: the global one gives a KJT of its features (and a
    [rows, 0] dense tensor), the local one (dense [B, Fd], KJT of its data_parallel features)."""
    local, global_ = rank_features(plan, placements, rank)

    def sub(names: list[str], suffix: str) -> Plan | None:
        keep = set(names)
        feats = [f for f in plan.features if f.name in keep]
        return Plan(name=f"{plan.name}@rank{rank}.{suffix}", features=feats) if feats else None

    return sub(local, "local"), sub(global_, "global")


def node_rows(graph: OpGraph, placements: Mapping[str, Placement], batch_size: int, world_size: int
              ) -> Callable[[Node], float]:
    """Rows a node of a worker's plan processes: the global batch when it feeds a table the worker holds
    (table_wise / column_wise), else the local batch (dense features, data_parallel tables)."""
    def rows(node: Node) -> float:
        if node.cls == "dense":
            return float(batch_size)
        feats = graph.features_of(node.id)
        held = any(f in placements and placements[f].kind != "data_parallel" for f in feats)
        return float(batch_size * world_size) if held else float(batch_size)

    return rows


def from_torchrec(summary: Mapping[str, Mapping]) -> dict[str, Placement]:
    """recforge.train.sharding.plan_summary(...) -> placements (the 'before' of a comparison)."""
    out = {}
    for table, info in summary.items():
        kind = info["sharding_type"]
        if kind not in ("table_wise", "column_wise", "data_parallel"):
            raise MappingError(f"table {table!r}: sharding type {kind!r} is not one the mapping handles")
        out[table] = Placement(kind, tuple(info["ranks"]))
    return out

