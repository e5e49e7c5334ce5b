"""Mapping MILP against brute force on tiny instances; per-rank plans; torchrec plans; bad input."""
from __future__ import annotations

import random

import pytest

from recforge.preprocess.planning.compiler import compile_plan
from recforge.preprocess.presets import load_plan
from recforge.rap.mapping.milp import (
    MappingCosts,
    MappingError,
    Placement,
    TableLoad,
    brute_force,
    candidate_placements,
    check_tables,
    evaluate,
    from_torchrec,
    node_rows,
    rank_features,
    rank_plan,
    solve,
    split_rank_plan,
)
from recforge.train.sharding import to_torchrec


def _instance(seed: int, world: int, n_tables: int):
    rng = random.Random(seed)
    tables = [TableLoad(name=f"t{i}", rows=rng.choice([10, 1000, 100_000]), dim=rng.choice([8, 16]),
                        prep_ms_global=rng.uniform(0.1, 2.0), prep_ms_local=0.0) for i in range(n_tables)]
    tables = [TableLoad(t.name, t.rows, t.dim, t.prep_ms_global, t.prep_ms_global / world) for t in tables]
    costs = MappingCosts(world_size=world, batch_size=64, base_ms=1.0, lookup_ms_per_value=rng.uniform(1e-4, 1e-3),
                         allreduce_ms_per_value=rng.uniform(1e-6, 1e-5), dense_prep_ms=0.2,
                         capacity_ms=[rng.uniform(0.0, 2.0) for _ in range(world)],
                         memory_values=rng.choice([float("inf"), 2_000_000.0]))
    return tables, costs


@pytest.mark.parametrize("seed", range(12))
def test_milp_matches_brute_force(seed):
    world, n = (2, 3) if seed % 2 else (3, 3)
    tables, costs = _instance(seed, world, n)
    best, _ = brute_force(tables, costs)
    res = solve(tables, costs)
    assert max(res.times.step_ms) == pytest.approx(best, rel=1e-6, abs=1e-9)
    assert max(evaluate(tables, res.placements, costs).step_ms) == pytest.approx(best, rel=1e-6, abs=1e-9)
    assert set(res.placements) == {t.name for t in tables}


def test_unhidden_preprocessing_moves_work_off_the_full_rank():
    # two equal tables, one rank already full of preprocessing: the MILP sends the heavy one to the other rank
    tables = [TableLoad("a", 100, 8, prep_ms_global=3.0, prep_ms_local=1.5),
              TableLoad("b", 100, 8, prep_ms_global=3.0, prep_ms_local=1.5)]
    costs = MappingCosts(world_size=2, batch_size=64, base_ms=5.0, lookup_ms_per_value=1e-4,
                         allreduce_ms_per_value=1.0, dense_prep_ms=0.0, capacity_ms=[0.0, 6.0])
    before = {"a": Placement("table_wise", (0,)), "b": Placement("table_wise", (0,))}
    res = solve(tables, costs)
    assert evaluate(tables, before, costs).imbalance > 0.2
    assert all(p == Placement("table_wise", (1,)) for p in res.placements.values())
    assert max(res.times.step_ms) < max(evaluate(tables, before, costs).step_ms)


def test_memory_that_fits_nothing_is_a_clear_error():
    tables, costs = _instance(0, 2, 2)
    tight = MappingCosts(**{**costs.__dict__, "memory_values": 1.0})
    with pytest.raises(MappingError, match="no table placement fits"):
        solve(tables, tight)


def test_candidates():
    assert [p.label() for p in candidate_placements(2, 16)] == [
        "table_wise[0]", "table_wise[1]", "column_wise[0, 1]", "data_parallel[0, 1]"]
    assert all(p.kind != "column_wise" for p in candidate_placements(3, 16))  # 16 columns do not split in 3


PLAN = load_plan("plan0")


def test_rank_plans_split_sparse_features_by_owner():
    tables = PLAN.sparse_features()
    placements = {t: Placement("table_wise", (i % 2,)) for i, t in enumerate(tables)}
    placements["C1"] = Placement("data_parallel", (0, 1))
    placements["C2"] = Placement("column_wise", (0, 1))
    local0, global0 = rank_features(PLAN, placements, 0)
    local1, global1 = rank_features(PLAN, placements, 1)
    assert "C1" in local0 and "C1" in local1 and "C2" in global0 and "C2" in global1
    owned = set(global0) | set(global1)
    assert owned == set(tables) - {"C1"}
    assert set(global0) & set(global1) == {"C2"}
    plan1 = rank_plan(PLAN, placements, 1)
    assert plan1.name == "rap_plan0@rank1" and set(plan1.sparse_features()) == set(global1) | {"C1"}
    compiled = compile_plan(plan1, method="greedy")
    rows = node_rows(compiled.graph, placements, batch_size=100, world_size=2)
    by_source = {n.source: rows(n) for n in compiled.graph.nodes if n.cls == "sparse"}
    assert by_source["C1"] == 100 and by_source["C2"] == 200
    assert all(rows(n) == 100 for n in compiled.graph.nodes if n.cls == "dense")


def test_split_rank_plan_separates_local_and_global_rows():
    tables = PLAN.sparse_features()
    placements = {t: Placement("table_wise", (i % 3,)) for i, t in enumerate(tables)}
    placements["C2"] = Placement("data_parallel", (0, 1, 2))
    placements["C4"] = Placement("column_wise", (0, 1, 2))
    for rank in range(3):
        local, global_ = split_rank_plan(PLAN, placements, rank)
        want_local, want_global = rank_features(PLAN, placements, rank)
        assert local.name == f"rap_plan0@rank{rank}.local" and global_.name == f"rap_plan0@rank{rank}.global"
        order = [f.name for f in PLAN.features]
        for sub, want in ((local, want_local), (global_, want_global)):
            names = [f.name for f in sub.features]
            assert sorted(names) == sorted(want) and names == sorted(names, key=order.index)  # plan order
            assert all(f == PLAN.features[order.index(f.name)] for f in sub.features)  # the same chains
        assert "C2" in local.sparse_features() and "C4" in global_.sparse_features()
        assert global_.dense_features() == [] and local.dense_features() == PLAN.dense_features()
        assert {f.name for f in local.features} | {f.name for f in global_.features} == \
            {f.name for f in rank_plan(PLAN, placements, rank).features}
    # no tables held: no global plan; only table_wise tables and no dense features: no local plan
    replicated = {t: Placement("data_parallel", (0, 1)) for t in tables}
    assert split_rank_plan(PLAN, replicated, 1)[1] is None
    sparse_only = PLAN.model_copy(update={"features": [f for f in PLAN.features if f.kind == "sparse"]})
    on_zero = {t: Placement("table_wise", (0,)) for t in tables}
    local, global_ = split_rank_plan(sparse_only, on_zero, 0)
    assert local is None and global_.sparse_features() == tables
    assert split_rank_plan(sparse_only, on_zero, 1) == (None, None)
    with pytest.raises(MappingError, match="I1_bucketize"):
        split_rank_plan(PLAN, {t: Placement("table_wise", (0,)) for t in tables[:-1]}, 0)


def test_plan_features_not_in_the_sharding_plan_are_named():
    tables = PLAN.sparse_features()
    with pytest.raises(MappingError, match=r"\['I1_bucketize'\] have no table"):
        check_tables(PLAN, tables[:-1])
    with pytest.raises(MappingError, match=r"\['X9'\] are not sparse features"):
        check_tables(PLAN, tables + ["X9"])
    with pytest.raises(MappingError, match="I1_bucketize"):
        rank_plan(PLAN, {t: Placement("table_wise", (0,)) for t in tables[:-1]}, 0)


def test_torchrec_plan_round_trip():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=10,
                                                            feature_names=[n]) for n in ("a", "b", "c")],
                                 device="meta")
    chosen = {"a": Placement("table_wise", (1,)), "b": Placement("column_wise", (0, 1)),
              "c": Placement("data_parallel", (0, 1))}
    plan = to_torchrec(chosen, ebc, world_size=2)
    summary = {t: {"sharding_type": ps.sharding_type, "ranks": list(ps.ranks or [0, 1])} for t, ps in plan.items()}
    assert from_torchrec(summary) == chosen
    with pytest.raises(MappingError, match="row_wise"):
        from_torchrec({"a": {"sharding_type": "row_wise", "ranks": [0, 1]}})
