"""The mapping file between plan_resources and the workers (recforge.rap.mapping.worker_mapping)."""
from __future__ import annotations

import json

import pytest

from recforge.config import DatasetConfig, DenseFeature, SparseFeature
from recforge.preprocess.planning.plan import criteo_plan
from recforge.rap.mapping.milp import Placement
from recforge.rap.mapping.worker_mapping import MappingFileError, load_mapping, mapped_jobs, write_mapping
from recforge.rap.planning.scheduler import mapped_rank_schedules
from recforge.rap.profiling.stages import STAGES

DS = DatasetConfig(name="tiny", dense=[DenseFeature(name="I1")],
                   sparse=[SparseFeature(name="C1", cardinality=40), SparseFeature(name="C2", cardinality=9),
                           SparseFeature(name="C3", cardinality=25)])
PLAN = criteo_plan(DS, table_cap=32)
PLACEMENTS = {"C1": Placement("table_wise", (1,)), "C2": Placement("data_parallel", (0, 1)),
              "C3": Placement("table_wise", (1,))}
B = 16


def _write(path, placements=PLACEMENTS, world=2):
    per_rank = [[s for _, s in mapped_rank_schedules(PLAN, placements, r, world, B, {s: 1.0 for s in STAGES},
                                                      {s: 0.2 for s in STAGES},
                                                      lambda c, rows: (lambda g: 0.001 * rows * len(g.nodes)))]
                for r in range(world)]
    write_mapping(path, placements, per_rank, world, B, {"placed_by": "test"})
    return per_rank


def test_round_trip_and_jobs_per_rank(tmp_path):
    path = tmp_path / "m.json"
    per_rank = _write(path)
    assert not list(tmp_path.glob("*.tmp"))  # written through a temp file
    r0, r1 = load_mapping(path, 2, 0), load_mapping(path, 2, 1)
    assert r0.placements == r1.placements == PLACEMENTS and r0.batch_size == B
    assert [s.meta["job"] for s in r0.schedules] == ["local"]  # rank 0 holds no table
    assert [s.meta["job"] for s in r1.schedules] == ["global", "local"]
    assert [s.to_json() for s in r1.schedules] == [s.to_json() for s in per_rank[1]]
    jobs = mapped_jobs(PLAN, DS, r1, 1)
    assert [ex.plan.sparse_features() for ex, _ in jobs] == [["C1", "C3"], ["C2"]]
    assert [s.meta["rows"] for _, s in jobs] == [2 * B, B]
    # gradient accumulation halves the local batch: the schedules' rows follow it
    halved = mapped_jobs(PLAN, DS, load_mapping(path, 2, 1), 1, batch_size=B // 2)
    assert [(s.meta["rows"], s.meta["planned_rows"]) for _, s in halved] == [(B, 2 * B), (B // 2, B)]


def test_another_world_size_runs_unmapped_with_the_same_table_kinds(tmp_path, caplog):
    path = tmp_path / "m.json"
    _write(path)
    assert load_mapping(path, 1, 0) is None
    assert "planned for 2 workers, the job runs 1" in caplog.text
    moved = load_mapping(path, 1, 0, dim=8)
    assert not moved.executed and moved.schedules == []
    assert moved.placements == {"C1": Placement("table_wise", (0,)), "C2": Placement("data_parallel", (0,)),
                                "C3": Placement("table_wise", (0,))}
    assert load_mapping(path, 2, 1, dim=8).executed


def test_placements_for_another_world_keep_each_table_kind():
    from recforge.rap.mapping.worker_mapping import placements_for_world

    planned = {"a": Placement("table_wise", (3,)), "b": Placement("column_wise", (0, 1, 2, 3)),
               "c": Placement("data_parallel", (0, 1, 2, 3))}
    assert placements_for_world(planned, 2, 16) == {
        "a": Placement("table_wise", (1,)), "b": Placement("column_wise", (0, 1)),
        "c": Placement("data_parallel", (0, 1))}
    # 12 columns do not split into 2 shards of a multiple of 4: the column_wise table goes table_wise (fused too)
    assert placements_for_world(planned, 2, 12)["b"] == Placement("table_wise", (1,))


def test_bad_files_name_what_is_wrong(tmp_path):
    path = tmp_path / "m.json"
    _write(path)
    doc = json.loads(path.read_text())
    for key in ("version", "placements", "ranks"):
        bad = dict(doc)
        del bad[key]
        path.write_text(json.dumps(bad))
        with pytest.raises(MappingFileError, match=repr(key)):
            load_mapping(path, 2, 0)
    path.write_text(json.dumps(doc | {"version": 99}))
    with pytest.raises(MappingFileError, match="version 99"):
        load_mapping(path, 2, 0)
    path.write_text(json.dumps(doc | {"ranks": doc["ranks"][:1]}))
    with pytest.raises(MappingFileError, match="1 ranks of schedules for world size 2"):
        load_mapping(path, 2, 0)
    # schedules from another placement: rank 1's global job is missing
    path.write_text(json.dumps(doc | {"ranks": [doc["ranks"][0], doc["ranks"][0]]}))
    with pytest.raises(MappingFileError, match="for plan .*@rank0.local.*expected .*@rank1.local"):
        mapped_jobs(PLAN, DS, load_mapping(path, 2, 1), 1)
    path.write_text(json.dumps(doc | {"ranks": [doc["ranks"][0], doc["ranks"][1][1:]]}))
    with pytest.raises(MappingFileError, match=r"no schedule for its \['global'\] job"):
        mapped_jobs(PLAN, DS, load_mapping(path, 2, 1), 1)


def test_jobs_must_match_what_the_sharded_model_takes(tmp_path):
    from types import SimpleNamespace

    from recforge.rap.runtime.corun_runtime import CorunConfigError, CorunRuntime
    from recforge.rap.runtime.session import check_jobs_match_sharding

    path = tmp_path / "m.json"
    _write(path)
    runtime = CorunRuntime(jobs=mapped_jobs(PLAN, DS, load_mapping(path, 2, 1), 1))
    try:
        check_jobs_match_sharding(runtime, SimpleNamespace(rank=1, global_features=["C3", "C1"], local_features=["C2"]))
        with pytest.raises(CorunConfigError, match=r"global job preprocesses \['C1', 'C3'\].*take \['C1'\]"):
            check_jobs_match_sharding(runtime, SimpleNamespace(rank=1, global_features=["C1"],
                                                               local_features=["C2", "C3"]))
    finally:
        runtime.close()
