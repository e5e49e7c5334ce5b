"""WorkerSpec: strict fields, cross-field checks, atomic save / load round trip."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from recforge.config import ModelConfig, TrainConfig, criteo_kaggle_dataset
from recforge.train.spec import WorkerSpec


def _spec(**over):
    base = dict(
        manifest_dir="/data/train", plan_path="/data/plan.json", dataset=criteo_kaggle_dataset().model_dump(),
        model=ModelConfig().model_dump(), train=TrainConfig().model_dump(), master_url="http://127.0.0.1:1234",
        checkpoint_dir="/out/ckpt", output_dir="/out/worker",
    )
    return {**base, **over}


def test_defaults_and_round_trip(tmp_path):
    spec = WorkerSpec.model_validate(_spec(seed=7, threads_per_worker=2))
    assert spec.tracking_uri is None and spec.mlflow_run_id is None
    path = spec.save(tmp_path / "sub" / "spec.json")
    assert json.loads(path.read_text())["seed"] == 7
    assert WorkerSpec.load(path) == spec
    assert not list(path.parent.glob(".spec.json.*"))  # no temp file left behind


def test_launcher_written_json_validates(tmp_path):
    """What recforge.elastic.job writes: the spec dict plus master_url and threads_per_worker."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(_spec(threads_per_worker=1, tracking_uri="sqlite:///x.db", mlflow_run_id="abc")))
    assert WorkerSpec.load(path).mlflow_run_id == "abc"


@pytest.mark.parametrize(
    "over, field",
    [
        (dict(unknown_field=1), "unknown_field"),
        (dict(threads_per_worker=0), "threads_per_worker"),
        (dict(master_url=""), "master_url"),
        (dict(train={**TrainConfig().model_dump(), "batch_sise": 3}), "batch_sise"),
        (dict(mlflow_run_id="abc"), "tracking_uri"),
        (dict(train=TrainConfig(fused_embeddings=False, sharding="table_wise").model_dump()), "train.sharding"),
    ],
)
def test_invalid_specs_name_the_field(over, field):
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        WorkerSpec.model_validate(_spec(**over))


def test_missing_required_field_and_missing_file(tmp_path):
    data = _spec()
    del data["master_url"]
    with pytest.raises(ValidationError, match="master_url"):
        WorkerSpec.model_validate(data)
    with pytest.raises(FileNotFoundError, match="worker spec not found"):
        WorkerSpec.load(tmp_path / "nope.json")
