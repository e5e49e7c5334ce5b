"""Preset plans 0-3 (YAML data files) and their datasets; load_plan by name or path."""
from __future__ import annotations

import pytest
import torch

from recforge.config import CRITEO_KAGGLE_CARDINALITIES, CRITEO_TERABYTE_CARDINALITIES, criteo_kaggle_dataset
from recforge.preprocess.planning.plan import Plan, PlanError
from recforge.preprocess.presets import PRESET_PLANS, load_plan, preset_dataset, preset_path


def chain(plan: Plan, name: str) -> list[str]:
    return [s.op for s in next(f for f in plan.features if f.name == name).ops]


@pytest.mark.parametrize("name", PRESET_PLANS)
def test_presets_load_and_validate(name):
    ds = preset_dataset(name)
    p = load_plan(name, ds)
    assert preset_path(name).exists() and p.name == f"rap_{name}"
    assert all(f.width == 1 for f in p.features)  # RAP's plans end every chain with one value per row
    assert set(p.sources()) <= set(ds.dense_names) | set(ds.sparse_names)


@pytest.mark.parametrize("name,cards", [("plan0", CRITEO_KAGGLE_CARDINALITIES),
                                        ("plan1", CRITEO_TERABYTE_CARDINALITIES)])
def test_plans_0_and_1(name, cards):
    p = load_plan(name, preset_dataset(name))
    assert p.dense_features() == [f"I{i}" for i in range(1, 14)]
    assert p.sparse_features() == [f"C{i}" for i in range(1, 27)] + ["I1_bucketize"]
    assert [n for _, n in p.tables()] == cards + [65536]
    assert chain(p, "I5") == ["fill_null", "logit"]
    assert chain(p, "C7") == ["fill_null", "sigrid_hash", "firstx"]
    bucket = next(f for f in p.features if f.name == "I1_bucketize")
    assert bucket.source == "I1" and bucket.ops[1].params == {"borders": [0.5, 1.0, 1.5]}
    assert p.features[0].ops[1].params == {"eps": 1e-5}


def test_plan0_totals_match_rap():
    assert sum(n for _, n in load_plan("plan0").tables()) == 33_762_577 + 65_536
    assert sum(n for _, n in load_plan("plan1").tables()) == 177_944_275 + 65_536


@pytest.mark.parametrize("name,nd,ns,groups", [
    ("plan2", 26, 52, {"logit": 7, "boxcox": 9, "onehot": 10, "hash4": 11, "clamp": 16, "firstx": 12, "ngram": 13}),
    ("plan3", 52, 104, {"logit": 16, "boxcox": 21, "onehot": 15, "hash4": 25, "clamp": 28, "firstx": 25, "ngram": 26}),
])
def test_plans_2_and_3(name, nd, ns, groups):
    ds = preset_dataset(name)
    assert (len(ds.dense), len(ds.sparse)) == (nd, ns)
    p = load_plan(name, ds)
    assert len(p.sparse_features()) == ns and len(p.dense_features()) == nd + groups["ngram"]
    assert all(n == 65536 for _, n in p.tables())
    chains = [tuple(s.op for s in f.ops) for f in p.features]
    assert chains.count(("fill_null",) + ("logit",) * 4) == groups["logit"]
    assert chains.count(("fill_null",) + ("boxcox",) * 4) == groups["boxcox"]
    assert chains.count(("fill_null", "onehot", "firstx")) == groups["onehot"]
    assert chains.count(("fill_null",) + ("sigrid_hash",) * 4) == groups["hash4"]
    assert chains.count(("fill_null",) + ("clamp",) * 4) == groups["clamp"]
    assert chains.count(("fill_null", "sigrid_hash", "firstx")) == groups["firstx"]
    assert chains.count(("fill_null", "sigrid_hash", "ngram", "firstx")) == groups["ngram"]
    assert chains.count(("fill_null", "onehot", "ngram", "firstx")) == groups["ngram"]
    onehot = next(f for f in p.features if f.ops[1].op == "onehot" and f.kind == "dense")
    assert onehot.ops[1].params == {"lo": 0.0, "hi": 16.0, "C": 5}


def test_load_plan_by_path_criteo_and_errors(tmp_path):
    ds = criteo_kaggle_dataset()
    path = load_plan("plan0").save(tmp_path / "p.json")
    assert load_plan(str(path), ds) == load_plan("plan0")
    assert load_plan("criteo", ds, table_cap=1000).tables()[2] == ("C3", 1000)
    assert load_plan("plan0", table_cap=1000).tables()[2] == ("C3", 1000)
    with pytest.raises(ValueError, match="needs the dataset"):
        load_plan("criteo")
    with pytest.raises(ValueError, match="neither a preset"):
        load_plan("plan9")
    with pytest.raises(FileNotFoundError):
        load_plan(tmp_path / "missing.yaml")
    with pytest.raises(PlanError, match="feature 'I14'.*source column 'I14'"):
        load_plan("plan2", ds)  # plan 2 reads 26 dense columns; Criteo has 13


def test_run_params_name_executor_plan_groups_and_dali_fallbacks():
    from recforge.preprocess.run_params import preprocess_params

    ds = preset_dataset("plan2")
    params, summary = preprocess_params(load_plan("plan2", ds), ds, "dali", "plan2")
    assert params["preprocess_executor"] == "dali" and params["preprocess_plan"] == "plan2"
    assert params["preprocess_plan_name"] == "rap_plan2"
    assert params["preprocess_planned_groups"] == len(summary["groups"]) and summary["planned"] is True
    assert "L0:fill_null_densex39" in params["preprocess_planned_group_names"]
    assert not any(k in params for k in ("preprocess_fused_groups", "preprocess_groups"))  # planned, not run
    assert params["preprocess_dali_fallback_ops"] == summary["dali"]["fallback_ops"] > 0
    assert "onehot" in params["preprocess_dali_fallback"] and "select" in summary["dali"]["fallback_reasons"][
        "boxcox_dense"]
    fused, _ = preprocess_params(load_plan("plan0", preset_dataset("plan0")), preset_dataset("plan0"), "fused", "plan0")
    assert "preprocess_dali_fallback" not in fused and fused["preprocess_compiler"].startswith("milp (optimal")
    assert all(len(str(v)) <= 6000 for v in params.values())  # MLflow's limit


@pytest.mark.parametrize("preset,plan_name", [("rap_plan2", "plan2"), ("rap_plan3", "plan3")])
def test_plan_2_and_3_datasets_are_pipeline_presets_over_generated_data(tmp_path, preset, plan_name):
    """generate -> ingest -> read a shard -> the plan (with the pipeline's table cap) on every executor path."""
    from recforge.config import PipelineConfig, dataset_preset
    from recforge.data.generator import generate_days
    from recforge.data.ingest import ingest
    from recforge.data.shards import read_rows
    from recforge.preprocess.batch import RawBatch
    from recforge.preprocess.executor import make_executor

    cfg = PipelineConfig(dataset_schema=preset, preprocess_plan=plan_name)
    ds = cfg.dataset()
    assert ds == preset_dataset(plan_name) == dataset_preset(preset)
    generate_days(ds, tmp_path / "raw", days=1, rows_per_day=300, seed=1)
    manifest = ingest(sorted((tmp_path / "raw").glob("day_*")), ds, tmp_path / "shards", rows_per_shard=200,
                      max_bad_fraction=0.0)
    assert manifest.total_rows == 300
    raw = RawBatch.from_arrow(read_rows(tmp_path / "shards", 0, 0, 150), ds)
    plan = load_plan(cfg.preprocess_plan, ds, cfg.table_cap)
    outs = [make_executor(name, plan, ds, **opts)(raw) for name, opts in
            (("eager", {}), ("fused", {}), ("fused", {"single_pass": False}))]
    for dense, kjt in outs[1:]:
        assert torch.equal(dense, outs[0][0]) or torch.allclose(dense, outs[0][0], rtol=1e-6, atol=0, equal_nan=True)
        assert torch.equal(kjt.values(), outs[0][1].values()) and kjt.keys() == plan.sparse_features()
    dense, kjt = outs[1]
    assert dense.shape == (150, len(plan.dense_features())) and kjt.lengths().eq(1).all()
    for name, rows in plan.tables():
        ids = kjt[name].values()
        assert ((ids >= 0) & (ids < rows)).all(), name


@pytest.mark.parametrize("name", ["plan2", "plan3"])
def test_recom_proves_one_id_per_row_for_plans_without_firstx(name):
    """RECom's gather form needs one id per row; plans 2-3 hash / clamp some features without firstx. Over
    PreprocessModule's scalar columns that still holds; over an executor's possible list columns it does not."""
    from recforge.preprocess.module import PreprocessModule
    from recforge.recom.columns.onehot import prove_one_hot
    from recforge.recom.errors import NotOneHotError

    ds = preset_dataset(name)
    plan = load_plan(name, ds)
    module = PreprocessModule(plan, ds)
    proofs = prove_one_hot(plan, plan.sparse_features(), scalar_sources=module.scalar_sources)
    assert sorted(proofs) == sorted(plan.sparse_features())
    assert "scalar source column" in proofs["C1"] and "firstx(1)" in proofs[plan.sparse_features()[-1]]
    with pytest.raises(NotOneHotError, match="'C1': its plan has no firstx"):
        prove_one_hot(plan, ["C1"])
