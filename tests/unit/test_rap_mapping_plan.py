"""A job's RAP mapping (recforge.rap.mapping.job_mapping): placements JSON, per-feature preprocessing costs, the MILP
over a synthetic stage profile against TorchRec's planner, and clear errors."""
from __future__ import annotations

import json

import pytest

from recforge.config import DatasetConfig, DenseFeature, ModelConfig, SparseFeature, TrainConfig
from recforge.preprocess.planning.compiler import compile_plan
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.job_mapping import (
    mapping_costs,
    placements_from_json,
    placements_to_json,
    plan_mapping,
    prep_costs,
)
from recforge.rap.mapping.milp import MappingCosts, MappingError, Placement, TableLoad, candidate_placements, evaluate
from recforge.rap.profiling.profiler import ProfileKey, ProfileMismatch, StageProfile
from recforge.rap.profiling.stages import STAGES
from recforge.train.sharding import check_placements

DS = DatasetConfig(
    name="small",
    dense=[DenseFeature(name=f"I{i}") for i in (1, 2)],
    sparse=[SparseFeature(name=f"C{i}", cardinality=c) for i, c in zip((1, 2, 3), (50, 70, 1000), strict=True)],
)


def _f(name, source, *ops, kind="sparse"):
    return {"name": name, "kind": kind, "source": source, "ops": [{"op": o, "params": p} for o, p in ops]}


# C1a and C1b share C1's fill_null -> sigrid_hash node (one unit of two features); C3 has the largest table.
PLAN = Plan.model_validate({"name": "tiny", "features": [
    *[_f(f"I{i}", f"I{i}", ("fill_null", {"value": 0}), ("logit", {"eps": 1e-5}), kind="dense") for i in (1, 2)],
    _f("C1a", "C1", ("fill_null", {"value": 0}), ("sigrid_hash", {"salt": 0, "M": 50}), ("firstx", {"X": 1})),
    _f("C1b", "C1", ("fill_null", {"value": 0}), ("sigrid_hash", {"salt": 0, "M": 50}), ("clamp", {"lo": 0, "hi": 9})),
    _f("C2", "C2", ("fill_null", {"value": 0}), ("sigrid_hash", {"salt": 1, "M": 70}), ("firstx", {"X": 1})),
    _f("C3", "C3", ("fill_null", {"value": 0}), ("sigrid_hash", {"salt": 1, "M": 1000}), ("firstx", {"X": 1})),
]})
TABLES = PLAN.tables()
MODEL = ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1])
WORLD, BATCH = 2, 64
LAUNCH_MS, NODE_MS, DENSE_MS = 0.05, 0.01, 0.02


def synthetic_timer(group):
    """A launch plus a per-node time for sparse groups; dense groups a flat time per node."""
    return len(group.nodes) * DENSE_MS if group.cls == "dense" else LAUNCH_MS + NODE_MS * len(group.nodes)


def _profile(capacity_ms=0.1, world=WORLD, batch=BATCH):
    stage_ms = dict(zip(STAGES, [0.4, 0.5, 0.7, 0.3, 0.2], strict=True))
    return StageProfile(key=ProfileKey.of(MODEL, TABLES, world, batch, "cpu"), stage_ms=stage_ms,
                        capacity_units={s: 1 for s in STAGES}, capacity_ms={s: capacity_ms / 5 for s in STAGES},
                        unit_ms=capacity_ms / 5, threshold=0.1)


def test_placements_json_round_trip():
    chosen = {"C3": Placement("table_wise", (1,)), "C1a": Placement("column_wise", (0, 1)),
              "C2": Placement("data_parallel", (0, 1))}
    text = placements_to_json(chosen)
    back = placements_from_json(text)
    assert back == chosen and list(back) == list(chosen)
    assert json.loads(text)["C3"] == {"kind": "table_wise", "ranks": [1]}


@pytest.mark.parametrize("text, match", [
    ("{", "not JSON"),
    ("[1, 2]", "expected an object of tables"),
    ('{"C1": 3}', "table 'C1': expected an object"),
    ('{"C1": {"kind": "table_wise"}}', "table 'C1': key 'ranks' missing"),
    ('{"C1": {"ranks": [0]}}', "table 'C1': key 'kind' missing"),
    ('{"C1": {"kind": "row_wise", "ranks": [0]}}', "table 'C1': 'kind' 'row_wise' is not one of"),
    ('{"C1": {"kind": "table_wise", "ranks": [0, 1]}}', "table 'C1'.*one rank"),
    ('{"C1": {"kind": "column_wise", "ranks": []}}', "table 'C1': 'ranks' must be a non-empty list"),
    ('{"C1": {"kind": "column_wise", "ranks": [0, -1]}}', "table 'C1': 'ranks'"),
    ('{"C1": {"kind": "column_wise", "ranks": ["0"]}}', "table 'C1': 'ranks'"),
    ('{"C1": {"kind": "data_parallel", "ranks": [0, 1], "rank": 0}}', r"table 'C1': unknown keys \['rank'\]"),
])
def test_bad_placements_json_names_table_and_key(text, match):
    with pytest.raises(MappingError, match=match):
        placements_from_json(text)


def test_prep_costs_split_launch_and_marginal_time():
    compiled = compile_plan(PLAN, method="greedy")
    per_feature, fixed = prep_costs(compiled, synthetic_timer)
    # C2, C3 own a node in each of their 3 layers; C1a and C1b share two (half each) and own one; C1b's clamp is
    # the only node of its group, so that launch is C1b's own cost (it runs only where C1b is preprocessed)
    assert per_feature == pytest.approx({"C1a": 2 * NODE_MS, "C1b": NODE_MS + LAUNCH_MS + NODE_MS,
                                         "C2": 3 * NODE_MS, "C3": 3 * NODE_MS})
    dense = sum(len(g.nodes) for g in compiled.groups if g.cls == "dense") * DENSE_MS
    shared_launches = sum(1 for g in compiled.groups if g.cls == "sparse" and len(g.nodes) > 1)
    assert shared_launches == 3 and fixed == pytest.approx(dense + shared_launches * LAUNCH_MS)


def test_costs_reproduce_the_profiled_step_for_an_even_placement():
    res = plan_mapping(PLAN, DS, TABLES, 8, 1, BATCH, _profile(world=1), synthetic_timer, model=MODEL)
    costs = res.info["costs"]
    train_ms = res.info["after"]["train_ms"][0]  # one rank: every table table_wise on it
    assert train_ms == pytest.approx(sum(_profile().stage_ms.values()))
    assert costs["capacity_ms"] == [pytest.approx(0.1)]


def heavy_c3_timer():
    """synthetic_timer, but C3's chain costs 20x per node: the planner (blind to preprocessing) leaves it whole
    on one rank, where its global-batch preprocessing does not hide."""
    graph = compile_plan(PLAN, method="greedy").graph

    def ms(group):
        if group.cls == "dense":
            return synthetic_timer(group)
        return LAUNCH_MS + sum(NODE_MS * (20 if "C3" in graph.features_of(n) else 1) for n in group.nodes)

    return ms


def test_plan_mapping_places_every_table_no_worse_than_the_planner():
    res = plan_mapping(PLAN, DS, TABLES, 8, WORLD, BATCH, _profile(), heavy_c3_timer(), model=MODEL)
    assert set(res.placements) == {t for t, _ in TABLES}
    for t, p in res.placements.items():
        assert p in candidate_placements(WORLD, 8), (t, p)
    check_placements(res.placements, dict.fromkeys(res.placements, 8), WORLD, TrainConfig())  # shard_model takes them
    before = placements_from_json(json.dumps(res.info["before"]["placements"]))
    assert set(before) == set(res.placements)
    loads = [_load_of(t) for t in res.info["tables"]]
    assert [t.pooling for t in loads] == [float(PLAN.features[i].width) for i in range(2, 6)]
    costs = _costs_of(res.info["costs"])
    after_t, before_t = evaluate(loads, res.placements, costs), evaluate(loads, before, costs)
    assert before_t.imbalance > 0.05  # the planner's placement leaves C3's preprocessing unhidden on one rank
    assert after_t.imbalance <= before_t.imbalance
    assert max(after_t.step_ms) < max(before_t.step_ms)
    assert res.info["after"]["imbalance"] == pytest.approx(after_t.imbalance)
    assert res.info["before"]["imbalance"] == pytest.approx(before_t.imbalance)
    # the global batch of a held table costs world x the local one
    c3 = next(t for t in loads if t.name == "C3")
    assert c3.prep_ms_local == pytest.approx(60 * NODE_MS)
    assert c3.prep_ms_global == pytest.approx(WORLD * c3.prep_ms_local)


def test_the_milp_minimizes_the_slowest_rank_not_the_imbalance():
    # uniform costs: the planner's placement happens to be balanced; the MILP's is faster though less even
    res = plan_mapping(PLAN, DS, TABLES, 8, WORLD, BATCH, _profile(), synthetic_timer, model=MODEL)
    assert res.info["after"]["max_step_ms"] <= res.info["before"]["max_step_ms"]


def test_plan_mapping_with_the_real_fused_executor():
    res = plan_mapping(PLAN, DS, TABLES, 8, WORLD, BATCH, _profile(), None, model=MODEL, compare_planner=False)
    assert set(res.placements) == {t for t, _ in TABLES} and "before" not in res.info
    assert all(v >= 0 for v in res.info["prep"]["per_feature_ms"].values())
    assert res.info["prep"]["fixed_ms"] > 0


def test_without_a_profile_the_planner_placement_is_kept():
    res = plan_mapping(PLAN, DS, TABLES, 8, WORLD, BATCH, None, synthetic_timer)  # no model: the EBC alone planned
    assert "no stage profile" in res.status
    assert set(res.placements) == {t for t, _ in TABLES}
    assert res.info["before"]["placements"] == res.info["after"]["placements"]


def test_a_table_that_fits_no_rank_is_named():
    # C3: 1000 rows x 8 = at least 4000 values on a rank (column_wise halves); the others fit in 2000
    with pytest.raises(MappingError, match=r"fit no rank's memory.*'C3'") as err:
        plan_mapping(PLAN, DS, TABLES, 8, WORLD, BATCH, _profile(), synthetic_timer, model=MODEL,
                     memory_bytes_per_rank=2000 * 4.0, compare_planner=False)
    assert "C2" not in str(err.value)


def test_bad_input_is_named():
    with pytest.raises(MappingError, match=r"\['C3'\] have no table"):
        plan_mapping(PLAN, DS, TABLES[:-1], 8, WORLD, BATCH, _profile(), synthetic_timer, model=MODEL)
    with pytest.raises(ProfileMismatch, match="world_size 4"):
        plan_mapping(PLAN, DS, TABLES, 8, WORLD, BATCH, _profile(world=4), synthetic_timer, model=MODEL)
    with pytest.raises(ProfileMismatch, match="model config"):
        other = ModelConfig(embedding_dim=8, dense_arch=[32, 8], over_arch=[16, 1])
        plan_mapping(PLAN, DS, TABLES, 8, WORLD, BATCH, _profile(), synthetic_timer, model=other)
    with pytest.raises(MappingError, match="sharding='auto'"):
        plan_mapping(PLAN, DS, TABLES, 8, WORLD, BATCH, _profile(), synthetic_timer, model=MODEL,
                     train=TrainConfig(sharding="table_wise"))
    with pytest.raises(MappingError, match="model= or allreduce_ms_per_value="):
        mapping_costs(_profile(), [], WORLD, BATCH, 0.0, None)


def _load_of(d):
    return TableLoad(**d)


def _costs_of(d):
    return MappingCosts(**d)
