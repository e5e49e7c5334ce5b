"""The executor path each batch really ran (recforge.preprocess.executors.record): the C++ kernels must not fall
back silently on the happy path, a forced fallback names its reason, and every path gives eager's values."""
from __future__ import annotations

import pytest
import torch

from recforge.config import DatasetConfig, DenseFeature, SparseFeature
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors import record
from recforge.preprocess.executors.dali import dali_available
from recforge.preprocess.planning.plan import Plan
from recforge.preprocess.synth import random_raw_batch
from recforge_kernels import cpu_ext
from recforge_kernels import fused as fused_ops

DS = DatasetConfig(
    name="tiny",
    dense=[DenseFeature(name="I1"), DenseFeature(name="I2")],
    sparse=[SparseFeature(name="C1", cardinality=50), SparseFeature(name="C2", cardinality=7)],
)


def f(name, kind, source, *ops, **extra):
    return {"name": name, "kind": kind, "source": source, "ops": [{"op": o, "params": p} for o, p in ops], **extra}


PLAN = Plan.model_validate({"name": "tiny", "features": [
    f("I1", "dense", "I1", ("fill_null", {"value": 0.5}), ("logit", {"eps": 1e-3})),
    f("I2", "dense", "I2", ("fill_null", {}), ("boxcox", {"lambda": 0.25}), ("clamp", {"lo": -2, "hi": 30})),
    f("C1", "sparse", "C1", ("fill_null", {"value": 3}), ("sigrid_hash", {"salt": 11, "M": 50})),
    f("C2", "sparse", "C2", ("fill_null", {}), ("mapid", {"map": [3, 2, 1]}), ("clamp", {"lo": 0, "hi": 9})),
    f("I2b", "sparse", "I2", ("fill_null", {}), ("bucketize", {"borders": [0.5, 1.0, 1.5]}), table_rows=8),
]})


def same_outputs(a, b) -> None:
    (da, ka), (db, kb) = a, b
    torch.testing.assert_close(da, db, rtol=1e-6, atol=0, equal_nan=True)
    assert ka.keys() == kb.keys()
    assert torch.equal(ka.values(), kb.values()) and torch.equal(ka.lengths(), kb.lengths())


def test_native_kernels_run_on_the_happy_path():
    """Fails when the C++ kernels do not build / load here, or the fused executor silently takes the fallback."""
    assert cpu_ext.load(), f"recforge_kernels' C++ kernels did not load: {cpu_ext.status()}"
    before = record.mark()
    single = make_executor("fused", PLAN, DS)
    grouped = make_executor("fused", PLAN, DS, single_pass=False)
    raw = random_raw_batch(DS, 64, seed=3)
    single(raw), single(raw), grouped(raw)
    assert single.executed.snapshot()["batches"] == {record.CPP_SINGLE_PASS: 2}
    assert grouped.executed.snapshot()["batches"] == {record.CPP_PER_GROUP: 1}
    got = record.summarize("fused", record.since(before))
    assert got["path"] == "cpp_single_pass+cpp_per_group" and got["native_kernels"] is True
    assert got["detail"]["batches"] == {"cpp_single_pass": 2, "cpp_per_group": 1}
    assert "single pass off (single_pass=False)" in got["detail"]["reasons"]["cpp_per_group"]


def test_forced_fallback_is_recorded_with_its_reason_and_gives_eager_values():
    raw = random_raw_batch(DS, 97, seed=5, null_rate=0.3, extreme_rate=0.2)
    eager = make_executor("eager", PLAN, DS)
    reference = eager(raw)
    native = make_executor("fused", PLAN, DS)
    same_outputs(native(raw), reference)

    before = record.mark()
    forced = make_executor("fused", PLAN, DS, native=False)  # the ops' torch fallback, by flag
    same_outputs(forced(raw), reference)
    got = record.summarize("fused", record.since(before))
    assert got["path"] == record.TORCH_FALLBACK and got["native_kernels"] is False
    assert got["detail"]["reasons"][record.TORCH_FALLBACK].startswith("native=False")

    before = record.mark()
    fused_ops.set_cpu_backend("torch")  # the process-wide switch: every fused executor falls back
    try:
        same_outputs(native(raw), reference)
    finally:
        fused_ops.set_cpu_backend("cpp")
    got = record.summarize("fused", record.since(before))
    assert got["path"] == record.TORCH_FALLBACK and got["native_kernels"] is False
    assert "set_cpu_backend('torch')" in got["detail"]["reasons"][record.TORCH_FALLBACK]
    assert "no C++ kernels" in got["detail"]["reasons"][record.TORCH_FALLBACK]

    before = record.mark()
    eager(raw)
    got = record.summarize("eager", record.since(before))
    assert (got["path"], got["native_kernels"]) == ("eager", False)


def test_list_columns_count_as_per_group_and_corun_group_calls_apart():
    ex = make_executor("fused", PLAN, DS)
    before = record.mark()
    ex(random_raw_batch(DS, 9, seed=1, list_columns=("C2",)))  # a list column: the single pass steps aside
    ex.run_group(0, ex.compiled.groups[0], random_raw_batch(DS, 9, seed=2), {})  # RAP's co-run: a group alone
    got = record.summarize("fused", record.since(before))
    assert got["detail"]["batches"] == {"cpp_per_group": 1} and got["detail"]["group_calls"] == {"cpp_per_group": 1}
    assert "list columns ['C2']" in got["detail"]["reasons"]["cpp_per_group"]
    assert record.summarize("fused", {"batches": {}, "group_calls": {}, "native": 0, "reasons": {}}) == {
        "requested": "fused", "path": "none", "native_kernels": False,
        "detail": {"batches": {}, "group_calls": {}, "reasons": {}}}


@pytest.mark.skipif(not dali_available(), reason="nvidia-dali not installed")
def test_dali_records_its_fallback_ops_and_the_path_that_ran_them():
    raw = random_raw_batch(DS, 33, seed=7)
    ex = make_executor("dali", PLAN, DS)
    before = record.mark()
    same_outputs(ex(raw), make_executor("eager", PLAN, DS)(raw))
    got = record.summarize("dali", record.since(before))
    assert got["detail"]["batches"] == {"dali": 1, "eager": 1}
    assert "{'boxcox': 1, 'clamp': 2, 'mapid': 1} ran cpp_per_group" in got["detail"]["reasons"]["dali"]
    assert got["native_kernels"] is False  # the eager reference ran in the window too
    before = record.mark()
    ex(random_raw_batch(DS, 5, seed=1, list_columns=("C2",)))  # a list column: the whole batch on fused
    got = record.summarize("dali", record.since(before))
    assert got["path"] == "cpp_per_group" and got["native_kernels"] is True
    assert "dali: a batch with list columns ran wholly on the fused executor" in got["detail"]["reasons"][
        "cpp_per_group"]
