"""Plan models: criteo_plan, JSON/YAML round trips, validation errors that name the feature and the op."""
from __future__ import annotations

import pydantic
import pytest

from recforge.config import (
    CRITEO_KAGGLE_CARDINALITIES,
    DatasetConfig,
    DenseFeature,
    SparseFeature,
    criteo_kaggle_dataset,
)
from recforge.preprocess.planning.plan import FeaturePlan, OpSpec, Plan, PlanError, criteo_plan

SMALL = DatasetConfig(
    name="small",
    dense=[DenseFeature(name="I1"), DenseFeature(name="I2")],
    sparse=[SparseFeature(name="C1", cardinality=50), SparseFeature(name="C2", cardinality=7)],
)


def feature(name, kind, source, *ops):
    return {"name": name, "kind": kind, "source": source, "ops": [{"op": o, "params": p} for o, p in ops]}


def plan(*features):
    return Plan.model_validate({"name": "t", "features": list(features)})


def test_criteo_plan_kaggle():
    ds = criteo_kaggle_dataset()
    p = criteo_plan(ds, table_cap=100_000)
    assert p.dense_features() == [f"I{i}" for i in range(1, 14)]
    assert p.sparse_features() == [f"C{i}" for i in range(1, 27)]
    assert p.tables() == [(f"C{i + 1}", min(c, 100_000)) for i, c in enumerate(CRITEO_KAGGLE_CARDINALITIES)]
    assert dict(p.tables())["C1"] == 1460 and dict(p.tables())["C3"] == 100_000
    dense = p.features[0]
    assert [(s.op, s.params) for s in dense.ops] == [("fill_null", {"value": 0}), ("logit", {"eps": 1e-5})]
    c3 = next(f for f in p.features if f.name == "C3")
    assert [(s.op, s.params) for s in c3.ops] == [
        ("fill_null", {"value": 0}), ("sigrid_hash", {"salt": 0, "M": 100_000}), ("firstx", {"X": 1}),
    ]
    uncapped = criteo_plan(ds, table_cap=10**9)
    assert [m for _, m in uncapped.tables()] == CRITEO_KAGGLE_CARDINALITIES
    with pytest.raises(ValueError, match="table_cap"):
        criteo_plan(ds, 0)


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_save_load_round_trip(tmp_path, suffix):
    p = criteo_plan(SMALL, table_cap=10)
    path = p.save(tmp_path / f"plan{suffix}")
    assert Plan.load(path) == p
    assert not list(tmp_path.glob("*.tmp"))


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        Plan.load(tmp_path / "missing.json")
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ValueError, match="empty"):
        Plan.load(tmp_path / "empty.yaml")


def test_defaults_are_filled_in():
    p = plan(feature("C1", "sparse", "C1", ("fill_null", {}), ("sigrid_hash", {"M": 9})))
    assert p.features[0].ops[1].params == {"salt": 0, "M": 9}
    assert p.features[0].ops[0].params == {"value": 0}


@pytest.mark.parametrize(
    "ops,op_name,fragment",
    [
        ([("fill_null", {}), ("hash_it", {})], "hash_it", "unknown op"),
        ([("fill_null", {}), ("sigrid_hash", {"salt": 0})], "sigrid_hash", "missing parameter 'M'"),
        ([("fill_null", {}), ("sigrid_hash", {"M": 5, "seed": 1})], "sigrid_hash", "unknown parameter 'seed'"),
        ([("fill_null", {}), ("sigrid_hash", {"M": 0})], "sigrid_hash", "parameter 'M'"),
        ([("fill_null", {}), ("sigrid_hash", {"M": 1.5})], "sigrid_hash", "parameter 'M'"),
        ([("fill_null", {}), ("sigrid_hash", {"M": "10"})], "sigrid_hash", "parameter 'M'"),
        ([("fill_null", {}), ("sigrid_hash", {"M": 5}), ("firstx", {"X": 0})], "firstx", "parameter 'X'"),
        ([("fill_null", {}), ("bucketize", {"borders": [1.0, 0.5]})], "bucketize", "increasing"),
        ([("fill_null", {}), ("clamp", {"lo": 3, "hi": 1})], "clamp", "lo <= hi"),
        ([("fill_null", {}), ("logit", {"eps": 0.7})], "logit", "parameter 'eps'"),
        ([("fill_null", {}), ("boxcox", {"lmbda": 1.0})], "boxcox", "missing parameter 'lambda'"),
    ],
)
def test_op_and_parameter_errors_name_feature_and_op(ops, op_name, fragment):
    with pytest.raises(pydantic.ValidationError) as e:
        plan(feature("C2", "sparse", "C2", *ops))
    msg = str(e.value)
    assert "'C2'" in msg and f"'{op_name}'" in msg and fragment in msg


def test_unbounded_sparse_ids_are_rejected():
    with pytest.raises(pydantic.ValidationError, match="'C1'.*unbounded"):
        plan(feature("C1", "sparse", "C1", ("fill_null", {}), ("firstx", {"X": 1})))
    with pytest.raises(pydantic.ValidationError, match="'C1'.*negative"):
        plan(feature("C1", "sparse", "C1", ("fill_null", {}), ("clamp", {"lo": -1, "hi": 5})))


def test_structure_errors():
    with pytest.raises(pydantic.ValidationError, match="repeated"):
        plan(feature("I1", "dense", "I1", ("fill_null", {})), feature("I1", "dense", "I2", ("fill_null", {})))
    with pytest.raises(pydantic.ValidationError, match="extra"):
        Plan.model_validate({"features": [{**feature("I1", "dense", "I1", ("fill_null", {})), "colour": "red"}]})
    with pytest.raises(pydantic.ValidationError, match="kind"):
        plan(feature("I1", "wide", "I1", ("fill_null", {})))
    with pytest.raises(pydantic.ValidationError, match="ops"):
        plan(feature("I1", "dense", "I1"))


@pytest.mark.parametrize(
    "feat,fragments",
    [
        (feature("X9", "dense", "I9", ("fill_null", {}), ("logit", {})), ["'X9'", "'I9'", "small"]),
        (feature("y", "dense", "label", ("fill_null", {})), ["'y'", "'label'"]),
        (
            feature("C1h", "sparse", "C1", ("fill_null", {}), ("logit", {}), ("sigrid_hash", {"M": 5})),
            ["'C1h'", "'logit'", "takes float values, got id"],
        ),
        (
            feature("I1h", "sparse", "I1", ("fill_null", {}), ("sigrid_hash", {"M": 5})),
            ["'I1h'", "'sigrid_hash'", "takes id values, got float"],
        ),
        (feature("I1", "dense", "I1", ("logit", {})), ["'I1'", "'logit'", "fill_null"]),
        (
            feature("I1", "dense", "I1", ("fill_null", {}), ("logit", {}), ("fill_null", {})),
            ["'I1'", "'fill_null'", "takes raw values"],
        ),
        (
            feature("C1", "sparse", "C1", ("fill_null", {"value": 0.5}), ("sigrid_hash", {"M": 5})),
            ["'C1'", "'fill_null'", "integer"],
        ),
        (
            feature("C1", "sparse", "C1", ("fill_null", {}), ("sigrid_hash", {"M": 5}),
                    ("clamp", {"lo": 0, "hi": 2.5})),
            ["'C1'", "'clamp'", "integers"],
        ),
        (feature("D", "dense", "C1", ("fill_null", {}), ("firstx", {"X": 1})), ["'D'", "'firstx'", "needs float"]),
        (
            feature("S", "sparse", "I1", ("fill_null", {}), ("clamp", {"lo": 0, "hi": 3})),
            ["'S'", "'clamp'", "needs id"],
        ),
    ],
)
def test_dataset_validation_errors_name_feature_and_op(feat, fragments):
    p = plan(feat)
    with pytest.raises(PlanError) as e:
        p.validate_for(SMALL)
    for frag in fragments:
        assert frag in str(e.value)


def test_valid_mixed_plan_and_table_sizes():
    p = plan(
        feature("I1", "dense", "I1", ("fill_null", {"value": 1.5}), ("boxcox", {"lambda": 0.0}),
                ("clamp", {"lo": -1, "hi": 9})),
        feature("I1_bucket", "sparse", "I1", ("fill_null", {}), ("bucketize", {"borders": [0.5, 1.0, 1.5]})),
        feature("C1", "sparse", "C1", ("fill_null", {"value": 3}), ("sigrid_hash", {"salt": 11, "M": 40}),
                ("clamp", {"lo": 0, "hi": 99})),
        feature("C2", "sparse", "C2", ("fill_null", {}), ("clamp", {"lo": 0, "hi": 6})),
    )
    p.validate_for(SMALL)
    assert p.tables() == [("I1_bucket", 4), ("C1", 40), ("C2", 7)]
    assert p.dense_features() == ["I1"]


def test_opspec_forbids_extra_fields():
    with pytest.raises(pydantic.ValidationError):
        OpSpec.model_validate({"op": "logit", "params": {}, "when": "always"})
    with pytest.raises(pydantic.ValidationError):
        FeaturePlan.model_validate({"name": "a", "kind": "dense", "ops": [{"op": "fill_null"}]})  # no source


# ---------------------------------------------------------------- ops added with issue 3


@pytest.mark.parametrize(
    "ops,op_name,fragment",
    [
        ([("fill_null", {}), ("onehot", {"lo": 0, "hi": 16})], "onehot", "missing parameter 'C'"),
        ([("fill_null", {}), ("onehot", {"lo": 3.0, "hi": 3.0, "C": 4})], "onehot", "lo < hi"),
        ([("fill_null", {}), ("ngram", {"n": 0})], "ngram", "parameter 'n'"),
        ([("fill_null", {}), ("mapid", {"map": []})], "mapid", "parameter 'map'"),
        ([("fill_null", {}), ("mapid", {"map": [1, 2**64]})], "mapid", "int64"),
        ([("fill_null", {}), ("cast", {"to": "int32"})], "cast", "parameter 'to'"),
    ],
)
def test_new_op_parameter_errors_name_feature_and_op(ops, op_name, fragment):
    with pytest.raises(pydantic.ValidationError) as e:
        plan(feature("C2", "sparse", "C2", *ops))
    msg = str(e.value)
    assert "'C2'" in msg and f"'{op_name}'" in msg and fragment in msg


@pytest.mark.parametrize(
    "feat,fragments",
    [
        (feature("I1", "dense", "I1", ("fill_null", {}), ("onehot", {"lo": 0, "hi": 8, "C": 4})),
         ["'I1'", "4 values per row", "firstx(1)"]),
        (feature("I1", "dense", "I1", ("fill_null", {}), ("onehot", {"lo": 0, "hi": 8, "C": 4}),
                 ("onehot", {"lo": 0, "hi": 8, "C": 4})),
         ["'I1'", "op #2 'onehot'", "one value per row"]),
        (feature("C1d", "dense", "C1", ("fill_null", {}), ("mapid", {"map": [3, 1]}), ("logit", {})),
         ["'C1d'", "'logit'", "takes float values, got id"]),
        (feature("C1", "sparse", "C1", ("fill_null", {}), ("cast", {"to": "float"}), ("mapid", {"map": [1]})),
         ["'C1'", "'mapid'", "takes id values, got float"]),
    ],
)
def test_width_and_type_errors_name_feature_and_op(feat, fragments):
    with pytest.raises(PlanError) as e:
        plan(feat).validate_for(SMALL)
    for frag in fragments:
        assert frag in str(e.value)


def test_widths_and_id_ranges_of_new_ops():
    p = plan(
        feature("I1", "dense", "I1", ("fill_null", {}), ("onehot", {"lo": 0, "hi": 16, "C": 8}), ("ngram", {"n": 4}),
                ("firstx", {"X": 1})),
        feature("C1", "sparse", "C1", ("fill_null", {}), ("sigrid_hash", {"M": 50}), ("ngram", {"n": 3})),
        feature("C2", "sparse", "C2", ("fill_null", {}), ("mapid", {"map": [16, 15, 14]})),
        feature("C2c", "sparse", "C2", ("fill_null", {}), ("cast", {"to": "float"}), ("bucketize", {"borders": [0.5]})),
    )
    p.validate_for(SMALL)
    assert [f.width for f in p.features] == [1, 1, 1, 1]
    assert p.tables() == [("C1", 50), ("C2", 17), ("C2c", 2)]
    wide = plan(feature("I1", "dense", "I1", ("fill_null", {}), ("onehot", {"lo": 0, "hi": 16, "C": 8}),
                        ("ngram", {"n": 4}), ("firstx", {"X": 1})))
    assert wide.features[0].width == 1
    assert plan(feature("C1", "sparse", "C1", ("fill_null", {}), ("sigrid_hash", {"M": 5}))).features[0].width == 1


def test_table_rows_override():
    bucketized = feature("b", "sparse", "I1", ("fill_null", {}), ("bucketize", {"borders": [0.5, 1.0]}))
    p = plan(bucketized | {"table_rows": 64})
    assert p.tables() == [("b", 64)]
    with pytest.raises(pydantic.ValidationError, match="'b'.*smaller than the id range"):
        plan(bucketized | {"table_rows": 2})
    with pytest.raises(pydantic.ValidationError, match="'d'.*sparse features only"):
        plan(feature("d", "dense", "I1", ("fill_null", {})) | {"table_rows": 9})


def test_with_table_cap():
    p = plan(feature("C1", "sparse", "C1", ("fill_null", {}), ("sigrid_hash", {"M": 5000})),
             feature("b", "sparse", "I1", ("fill_null", {}), ("bucketize", {"borders": [0.5, 1.0]}))
             | {"table_rows": 900})
    capped = p.with_table_cap(100)
    assert capped.tables() == [("C1", 100), ("b", 100)]
    assert p.with_table_cap(10**6) is p
    assert p.with_table_cap(2).tables() == [("C1", 2), ("b", 3)]  # never below the ids the ops make
    with pytest.raises(ValueError, match="table_cap"):
        p.with_table_cap(0)


def test_missing_source_names_feature_column_and_op():
    with pytest.raises(PlanError, match=r"feature 'X': source column 'nope' \(read by op #0 'fill_null'\)"):
        plan(feature("X", "dense", "nope", ("fill_null", {}))).validate_for(SMALL)
