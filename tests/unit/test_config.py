"""Malformed configuration fails at the edge with an error that names the field."""
import pytest
from pydantic import ValidationError

from recforge.config import PipelineConfig, criteo_kaggle_dataset, dataset_preset, load_config, wide_dataset


def test_defaults_are_valid_and_presets_have_the_right_shape():
    cfg = PipelineConfig()
    ds = cfg.dataset()
    assert (len(ds.dense), len(ds.sparse), ds.num_fields) == (13, 26, 40)
    assert ds.sparse[2].cardinality == 10131227
    wide = wide_dataset()
    assert len(wide.sparse) == 400 and len({f.name for f in wide.sparse}) == 400


@pytest.mark.parametrize(
    "data, field",
    [
        ({"rows_per_day": 10}, "rows_per_day"),
        ({"train": {"batch_size": 0}}, "train.batch_size"),
        ({"model": {"arch": "transformer"}}, "model.arch"),
        ({"model": {"embedding_dim": 8}}, "model"),  # dense_arch must end at embedding_dim
        ({"resources": {"workers": 0}}, "resources.workers"),
        ({"dataset_schema": "nope"}, "dataset_schema"),
        ({"trian": {}}, "trian"),  # typo: unknown field is an error, not ignored
    ],
)
def test_bad_fields_are_named(data, field):
    with pytest.raises(ValidationError) as err:
        PipelineConfig.model_validate(data)
    locs = [".".join(str(p) for p in e["loc"]) for e in err.value.errors()]
    assert any(loc == field or loc.startswith(field) for loc in locs), locs


def test_embedding_dim_mismatch_message():
    with pytest.raises(ValidationError, match="dense_arch.*embedding_dim"):
        PipelineConfig.model_validate({"model": {"embedding_dim": 8}})


def test_duplicate_column_names_rejected():
    ds = criteo_kaggle_dataset().model_dump()
    ds["columns"][14]["name"] = "I1"  # C1 renamed to a dense column's name
    with pytest.raises(ValidationError, match="I1"):
        type(criteo_kaggle_dataset()).model_validate(ds)


def test_load_config_files(tmp_path):
    good = tmp_path / "c.yaml"
    good.write_text("rows_per_day: 1000\ntrain:\n  epochs: 2\n")
    cfg = load_config(good)
    assert cfg.rows_per_day == 1000 and cfg.train.epochs == 2
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    empty = tmp_path / "e.yaml"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_config(empty)
    with pytest.raises(ValueError, match="unknown preset"):
        dataset_preset("nope")
