"""CorunSchedule: JSON round trip, validation errors naming the problem, and split parts run by the real fused
executor giving the same output as the whole plan."""
from __future__ import annotations

import pytest
import torch

from every_op_plan import f as _f
from recforge.config import DatasetConfig, DenseFeature, SparseFeature
from recforge.preprocess.columns import finish
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.planning.compiler import compile_plan
from recforge.preprocess.planning.plan import Plan
from recforge.preprocess.synth import random_raw_batch
from recforge.rap.planning.schedule import (
    Assignment,
    CorunSchedule,
    ScheduleError,
    executable_parts,
    group_features,
    restrict,
    split_units,
    whole_kernel_schedule,
)
from recforge.rap.profiling.stages import STAGES

DS = DatasetConfig(
    name="small",
    dense=[DenseFeature(name=f"I{i}") for i in (1, 2, 3)],
    sparse=[SparseFeature(name=f"C{i}", cardinality=c) for i, c in zip((1, 2, 3), (50, 70, 1000), strict=True)],
)


# C1a and C1b share fill_null -> sigrid_hash of C1 (one node each), then differ.
PLAN = Plan.model_validate({"name": "tiny", "features": [
    *[_f(f"I{i}", "dense", f"I{i}", ("fill_null", {"value": 0}), ("logit", {"eps": 1e-5})) for i in (1, 2, 3)],
    _f("C1a", "sparse", "C1", ("fill_null", {"value": 0}), ("sigrid_hash", {"salt": 0, "M": 50}), ("firstx", {"X": 1})),
    _f("C1b", "sparse", "C1", ("fill_null", {"value": 0}), ("sigrid_hash", {"salt": 0, "M": 50}),
       ("clamp", {"lo": 0, "hi": 9})),
    *[_f(f"C{i}", "sparse", f"C{i}", ("fill_null", {"value": 0}), ("sigrid_hash", {"salt": 1, "M": 40}),
         ("firstx", {"X": 1})) for i in (2, 3)],
]})


@pytest.fixture(scope="module")
def compiled():
    return compile_plan(PLAN, method="greedy")


def _group(compiled, op, cls):
    return next(g for g in compiled.groups if g.op == op and g.cls == cls)


def test_units_keep_shared_prefix_features_together(compiled):
    sh = _group(compiled, "sigrid_hash", "sparse")
    assert split_units(compiled, sh) == [("C1a", "C1b"), ("C2",), ("C3",)]
    assert group_features(compiled, sh) == ("C1a", "C1b", "C2", "C3")
    part = restrict(compiled, sh, ["C3", "C2"])
    assert len(part.nodes) == 2 and part.op == "sigrid_hash" and part.layer == sh.layer
    with pytest.raises(ScheduleError, match=r"computes features \['C1a', 'C1b'\] together"):
        restrict(compiled, sh, ["C1a"])
    with pytest.raises(ScheduleError, match="'I1'.*not computed"):
        restrict(compiled, sh, ["I1"])


def _split_schedule(compiled):
    """The sparse fill_null whole in mlp_bwd; the rest in allreduce, sigrid_hash split into two parts."""
    items = []
    for g in compiled.groups:
        if g.op == "sigrid_hash":
            items.append(Assignment("allreduce", g.name, ("C2",), 0.1))
            items.append(Assignment("allreduce", g.name, ("C1a", "C1b", "C3"), 0.2))
        else:
            items.append(Assignment("allreduce", g.name, group_features(compiled, g), 0.3))
    first = next(a for a in items if a.group == _group(compiled, "fill_null", "sparse").name)
    items.remove(first)
    items.insert(0, Assignment("mlp_bwd", first.group, first.features, first.predicted_ms))
    return CorunSchedule(stages=STAGES, assignments=items, plan_name=PLAN.name, meta={"note": "test"})


def test_json_round_trip_and_by_stage(compiled):
    sched = _split_schedule(compiled)
    sched.validate(compiled)
    back = CorunSchedule.from_json(sched.to_json())
    assert back == sched
    stages = back.by_stage()
    assert list(stages) == list(STAGES) and len(stages["mlp_bwd"]) == 1 and stages["emb_fwd"] == []
    assert back.predicted_ms_by_stage()["mlp_bwd"] == pytest.approx(0.3)


def test_parts_run_by_the_fused_executor_equal_the_whole_plan(compiled):
    raw = random_raw_batch(DS, 64, seed=3)
    ex = FusedExecutor(PLAN, DS, compiled=compiled)
    want_dense, want_kjt = ex(raw)
    parts = executable_parts(compiled, _split_schedule(compiled))
    assert len({p.key for p in parts}) == len(parts)
    vals: dict = {}
    for p in parts:
        ex.run_group(p.key, p.group, raw, vals)
    dense, kjt = finish(PLAN, {f: vals[n] for f, n in compiled.graph.outputs.items()}, raw.rows, raw.dense.device)
    torch.testing.assert_close(dense, want_dense, rtol=0, atol=0)
    assert torch.equal(kjt.values(), want_kjt.values()) and kjt.keys() == want_kjt.keys()
    # and the whole plan again through the same executor: its per-group caches were not polluted by the parts
    again_dense, again_kjt = ex(raw)
    torch.testing.assert_close(again_dense, want_dense, rtol=0, atol=0)
    assert torch.equal(again_kjt.values(), want_kjt.values())


def test_whole_kernel_schedule_is_valid(compiled):
    s = whole_kernel_schedule(compiled, "allreduce")
    s.validate(compiled)
    assert [a.group for a in s.assignments] == [g.name for g in compiled.groups]


def _with(sched, items):
    return CorunSchedule(stages=sched.stages, assignments=items, plan_name=sched.plan_name)


def test_missing_feature_names_group_and_feature(compiled):
    s = _split_schedule(compiled)
    items = [a for a in s.assignments if a.features != ("C2",)]
    with pytest.raises(ScheduleError, match=r"sigrid_hash_sparsex3'.*\['C2'\] are not scheduled"):
        _with(s, items).validate(compiled)


def test_twice_scheduled_feature(compiled):
    s = _split_schedule(compiled)
    dup = next(a for a in s.assignments if a.features == ("C2",))
    with pytest.raises(ScheduleError, match="'C2' is scheduled twice"):
        _with(s, s.assignments + [dup]).validate(compiled)


def test_unknown_group_feature_stage_and_plan(compiled):
    s = _split_schedule(compiled)
    a0 = s.assignments[0]
    with pytest.raises(ScheduleError, match="unknown fused group 'L9:nope'"):
        _with(s, [Assignment(a0.stage, "L9:nope", a0.features, 0.0)] + s.assignments[1:]).validate(compiled)
    with pytest.raises(ScheduleError, match="'Z9'"):
        _with(s, [Assignment(a0.stage, a0.group, a0.features + ("Z9",), 0.0)] + s.assignments[1:]).validate(compiled)
    with pytest.raises(ScheduleError, match="stage 'warmup'"):
        _with(s, [Assignment("warmup", a0.group, a0.features, 0.0)] + s.assignments[1:]).validate(compiled)
    with pytest.raises(ScheduleError, match=r"unknown stages \['warmup'\]"):
        CorunSchedule(("warmup",), s.assignments, s.plan_name).validate(compiled)
    with pytest.raises(ScheduleError, match="plan 'other'"):
        CorunSchedule(s.stages, s.assignments, "other").validate(compiled)


def test_order_errors(compiled):
    s = _split_schedule(compiled)
    with pytest.raises(ScheduleError, match="stage order"):
        _with(s, s.assignments[1:] + s.assignments[:1]).validate(compiled)
    # a consumer before its input, same stage
    items = list(s.assignments)
    i = next(k for k, a in enumerate(items) if a.group.endswith("logit_densex3"))
    j = next(k for k, a in enumerate(items) if a.group.endswith("fill_null_densex3"))
    items[i], items[j] = items[j], items[i]
    with pytest.raises(ScheduleError, match="before its input"):
        _with(s, items).validate(compiled)


def test_from_json_names_missing_keys():
    with pytest.raises(ScheduleError, match="'assignments'"):
        CorunSchedule.from_json('{"plan_name": "x", "stages": []}')
    with pytest.raises(ScheduleError, match=r"#0 misses \['predicted_ms'\]"):
        CorunSchedule.from_json('{"plan_name": "x", "stages": [], "assignments": [{"stage": "a", "group": "g", '
                                '"features": []}]}')
