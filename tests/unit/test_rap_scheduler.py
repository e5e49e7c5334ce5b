"""Co-run scheduler: stage ranking, every split size, exhaustive-search reference on tiny cases, real plans."""
from __future__ import annotations

import itertools
import random

import pytest

from recforge.preprocess.planning.compiler import compile_plan
from recforge.preprocess.planning.plan import Plan
from recforge.preprocess.presets import load_plan
from recforge.rap.mapping.milp import Placement
from recforge.rap.planning.scheduler import (
    group_cost,
    mapped_rank_schedules,
    pack,
    rank_stages,
    schedule,
    select_stages,
)
from recforge.rap.profiling.cost_model import CostModel
from recforge.rap.profiling.stages import STAGES


def _cost_fn(weights, overhead):
    """Part cost: a launch overhead plus the part's unit weights (sub-parts never cost more)."""
    return lambda k, lo, hi: overhead + sum(weights[k][lo:hi])


def _best_within_capacity(weights, overhead, stages, capacity):
    """Exhaustive: cut the unit sequence into one contiguous segment per stage (in order); the most units placed
    with every stage within capacity."""
    flat = [(k, i) for k, ws in enumerate(weights) for i in range(len(ws))]
    cost = _cost_fn(weights, overhead)

    def segment_cost(a, b):
        total = 0.0
        for k in {flat[j][0] for j in range(a, b)}:
            idx = [flat[j][1] for j in range(a, b) if flat[j][0] == k]
            total += cost(k, idx[0], idx[-1] + 1)
        return total

    best = 0
    for cuts in itertools.combinations_with_replacement(range(len(flat) + 1), len(stages)):
        start, ok = 0, True
        for s, end in zip(stages, cuts, strict=True):
            if segment_cost(start, end) > capacity[s] + 1e-12:
                ok = False
                break
            start = end
        if ok:
            best = max(best, cuts[-1])
    return best


@pytest.mark.parametrize("seed", range(40))
def test_pack_places_as_much_as_exhaustive_search(seed):
    rng = random.Random(seed)
    weights = [[rng.choice([0.5, 1.0, 2.0]) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]
    overhead = rng.choice([0.0, 0.3])
    stages = list(STAGES[: rng.randint(1, 3)])
    capacity = {s: rng.choice([0.0, 1.0, 2.5, 4.0]) for s in stages}
    placed = pack([len(w) for w in weights], _cost_fn(weights, overhead), stages, capacity)
    # every unit placed exactly once, in order
    seen = [(p.kernel, u) for p in placed for u in range(p.lo, p.hi)]
    assert seen == [(k, i) for k, ws in enumerate(weights) for i in range(len(ws))]
    load = {s: 0.0 for s in stages}
    within = 0
    for p in placed:
        load[p.stage] += p.ms
        if load[p.stage] <= capacity[p.stage] + 1e-12:
            within += p.hi - p.lo
    assert within == _best_within_capacity(weights, overhead, stages, capacity)


def test_split_tries_every_size_not_only_units_minus_one():
    # 4 units of 1 ms, 2.5 ms of capacity: the artifact tries only a 3-unit prefix (3 ms, no fit) and moves on
    placed = pack([4], _cost_fn([[1.0] * 4], 0.0), ["mlp_bwd", "allreduce"], {"mlp_bwd": 2.5, "allreduce": 2.0})
    assert [(p.stage, p.lo, p.hi) for p in placed] == [("mlp_bwd", 0, 2), ("allreduce", 2, 4)]


def test_leftovers_go_into_the_last_taken_stage():
    placed = pack([2, 1], _cost_fn([[1.0, 1.0], [5.0]], 0.0), ["emb_fwd", "mlp_bwd"], {"emb_fwd": 1.0, "mlp_bwd": 1.0})
    assert [(p.stage, p.kernel, p.lo, p.hi) for p in placed] == [
        ("emb_fwd", 0, 0, 1), ("mlp_bwd", 0, 1, 2), ("mlp_bwd", 1, 0, 1)]


def test_stage_ranking_and_selection():
    dur = dict(zip(STAGES, [1.0, 2.0, 2.0, 1.0, 1.0], strict=True))
    cap = dict(zip(STAGES, [0.5, 0.4, 3.0, 0.0, 2.0], strict=True))
    assert rank_stages(dur, cap) == ["allreduce", "mlp_bwd", "emb_fwd", "mlp_fwd", "emb_bwd"]
    assert select_stages(dur, cap, 1.5) == (["allreduce"], False)
    assert select_stages(dur, cap, 4.0) == (["mlp_bwd", "allreduce"], False)
    assert select_stages(dur, cap, 100.0) == (list(STAGES), True)
    assert rank_stages({**dur, "emb_fwd": 0.0}, cap)[0] == "emb_fwd"  # capacity in no time: infinite intensity


FLAT = CostModel({op: [0.01, 0.0, 1e-5, 0.0, 0.0]
                  for op in ("fill_null", "logit", "sigrid_hash", "firstx", "bucketize")})


def test_schedule_of_a_real_plan_is_valid_and_splits_at_the_edge():
    compiled = compile_plan(load_plan("plan0"), method="greedy")
    cost = group_cost(FLAT, compiled, 1024.0)
    dur = {**dict.fromkeys(STAGES, 1.0), "emb_fwd": 0.5}
    total = sum(cost(g) for g in compiled.groups)
    # only emb_fwd and allreduce have capacity; emb_fwd ranks first, holds a bit more than half the work
    cap = {**dict.fromkeys(STAGES, 0.0), "emb_fwd": total * 0.55, "allreduce": total * 0.5}
    sched = schedule(compiled, dur, cap, cost)
    sched.validate(compiled)
    stages = sched.by_stage()
    assert set(a.stage for a in sched.assignments) == {"emb_fwd", "allreduce"}
    assert sched.predicted_ms_by_stage()["emb_fwd"] <= cap["emb_fwd"] + 1e-12
    assert sched.meta["split_kernels"] == 1 and sched.meta["taken_stages"] == ["emb_fwd", "allreduce"]
    split = [a.group for a in stages["emb_fwd"]][-1]
    assert split in [a.group for a in stages["allreduce"]]
    assert sched.meta["unhidden_ms"] == pytest.approx(0.0, abs=1e-12)


def test_schedule_without_capacity_puts_everything_last_and_reports_overflow():
    compiled = compile_plan(load_plan("plan0"), method="greedy")
    sched = schedule(compiled, dict.fromkeys(STAGES, 1.0), dict.fromkeys(STAGES, 0.0),
                     group_cost(FLAT, compiled, 1024.0))
    assert {a.stage for a in sched.assignments} == {"allreduce"}
    assert sched.meta["overflow"] and sched.meta["unhidden_ms"] == pytest.approx(sched.meta["total_predicted_ms"])


def test_schedule_names_missing_profile_stages():
    compiled = compile_plan(load_plan("plan0"), method="greedy")
    with pytest.raises(ValueError, match="allreduce"):
        schedule(compiled, {s: 1.0 for s in STAGES[:4]}, dict.fromkeys(STAGES, 1.0), group_cost(FLAT, compiled, 8.0))


# ------------------------------------------------------------------ RAP's mapping: a global and a local job per rank

PLAN0 = load_plan("plan0")
TABLES = PLAN0.sparse_features()
B, WORLD = 64, 4


def rows_cost(compiled, rows):
    """ms = 0.05 launch + 1e-4 per node and row: depends on rows, so the job's rows are visible in the costs."""
    return lambda g: 0.05 + 1e-4 * len(g.nodes) * rows


def _placements(seed):
    rng = random.Random(seed)
    out = {t: Placement("table_wise", (rng.randrange(WORLD),)) for t in TABLES}
    for t in rng.sample(TABLES, 4):
        out[t] = Placement(rng.choice(["data_parallel", "column_wise"]), tuple(range(WORLD)))
    return out


@pytest.mark.parametrize("seed", range(10))  # seeds 5 and 6 overflow, several split a kernel
def test_mapped_jobs_share_the_capacity(seed):
    rng = random.Random(seed)
    placements = _placements(seed)
    rank = rng.randrange(WORLD)
    dur = {s: rng.uniform(0.5, 3.0) for s in STAGES}
    cap = {s: rng.choice([0.0, 0.1, 0.2, 0.4, 0.8]) for s in STAGES}  # around the jobs' ~1.3 ms: splits, overflow
    jobs = mapped_rank_schedules(PLAN0, placements, rank, WORLD, B, dur, cap, rows_cost)
    assert [s.meta["job"] for _, s in jobs] == ["global", "local"]
    load = dict.fromkeys(STAGES, 0.0)
    given = []  # (job's schedule, the capacity it was given)
    for compiled, sched in jobs:
        sched.validate(compiled)
        rows = WORLD * B if sched.meta["job"] == "global" else B
        assert sched.meta["rows"] == rows and sched.meta["rank"] == rank and sched.meta["world_size"] == WORLD
        assert compiled.plan.name == f"rap_plan0@rank{rank}.{sched.meta['job']}" == sched.plan_name
        assert sched.meta["stage_capacity_ms"] == cap
        given.append((sched, sched.meta["capacity_ms"]))
        for s, ms in sched.predicted_ms_by_stage().items():
            load[s] += ms
    # the local job got what the global job left
    global_load = given[0][0].predicted_ms_by_stage()
    assert given[1][1] == pytest.approx({s: max(0.0, cap[s] - global_load[s]) for s in STAGES})
    for s in STAGES:
        if load[s] <= cap[s] + 1e-9:
            continue
        # over capacity only by a job's leftovers, in its last taken stage
        over = [sch for sch, c in given if sch.predicted_ms_by_stage()[s] > c[s] + 1e-9]
        assert over and all(sch.meta["taken_stages"][-1] == s for sch in over), (s, load[s], cap[s])


def test_mapped_jobs_cost_the_global_job_at_the_global_rows():
    placements = {t: Placement("table_wise", (0,)) if i % 2 else Placement("data_parallel", tuple(range(WORLD)))
                  for i, t in enumerate(TABLES)}
    big = dict.fromkeys(STAGES, 1e6)  # no splits: every assignment is a whole group
    jobs = mapped_rank_schedules(PLAN0, placements, 0, WORLD, B, dict.fromkeys(STAGES, 1.0), big, rows_cost)
    for compiled, sched in jobs:
        rows = sched.meta["rows"]
        by_name = {g.name: g for g in compiled.groups}
        assert [a.group for a in sched.assignments] == [g.name for g in compiled.groups]
        for a in sched.assignments:
            assert a.predicted_ms == pytest.approx(0.05 + 1e-4 * len(by_name[a.group].nodes) * rows)
    assert [s.meta["rows"] for _, s in jobs] == [WORLD * B, B]
    assert sorted(jobs[0][0].plan.sparse_features()) == sorted(TABLES[1::2])


def test_a_rank_holding_no_tables_gets_only_the_local_job():
    placements = {t: Placement("table_wise", (1,)) for t in TABLES}
    placements["C3"] = Placement("data_parallel", tuple(range(WORLD)))
    jobs = mapped_rank_schedules(PLAN0, placements, 0, WORLD, B, dict.fromkeys(STAGES, 1.0),
                                 dict.fromkeys(STAGES, 1.0), rows_cost)
    assert len(jobs) == 1 and jobs[0][1].meta["job"] == "local" and jobs[0][1].meta["rows"] == B
    assert jobs[0][0].plan.sparse_features() == ["C3"]
    assert jobs[0][1].meta["capacity_ms"] == dict.fromkeys(STAGES, 1.0)  # all of it: no global job before it


def test_table_wise_only_without_dense_features_gets_only_the_global_job():
    sparse_only = Plan(name="sparse_only", features=[f for f in PLAN0.features if f.kind == "sparse"])
    placements = {t: Placement("table_wise", (i % 2,)) for i, t in enumerate(TABLES)}
    jobs = mapped_rank_schedules(sparse_only, placements, 1, 2, B, dict.fromkeys(STAGES, 1.0),
                                 dict.fromkeys(STAGES, 1.0), rows_cost)
    assert len(jobs) == 1 and jobs[0][1].meta["job"] == "global" and jobs[0][1].meta["rows"] == 2 * B
    assert jobs[0][0].plan.sparse_features() == TABLES[1::2]
    # a rank with nothing to preprocess
    alone = {t: Placement("table_wise", (0,)) for t in TABLES}
    assert mapped_rank_schedules(sparse_only, alone, 1, 2, B, dict.fromkeys(STAGES, 1.0),
                                 dict.fromkeys(STAGES, 1.0), rows_cost) == []
    with pytest.raises(ValueError, match="rank 2"):
        mapped_rank_schedules(sparse_only, alone, 2, 2, B, dict.fromkeys(STAGES, 1.0),
                              dict.fromkeys(STAGES, 1.0), rows_cost)
