"""The worker contract: WorkerSpec (strict fields, cross-field checks, atomic save / load round trip; the pipeline
builds it without master_url, the launcher fills it in) and WorkerResult (what rank 0 writes, read back typed)."""
from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from recforge.config import ModelConfig, TrainConfig, criteo_kaggle_dataset
from recforge.train.result import RESULT_FILE, WorkerResult
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
    del data["manifest_dir"]
    with pytest.raises(ValidationError, match="manifest_dir"):
        WorkerSpec.model_validate(data)
    with pytest.raises(FileNotFoundError, match="worker spec not found"):
        WorkerSpec.load(tmp_path / "nope.json")


def test_the_pipeline_builds_it_without_master_url_but_a_worker_needs_one(tmp_path):
    data = _spec()
    del data["master_url"]
    unlaunched = WorkerSpec.model_validate(data)  # what the train stage hands run_training_job
    assert unlaunched.master_url is None
    path = unlaunched.save(tmp_path / "spec.json")
    with pytest.raises(ValueError, match="master_url: required to run a worker"):
        WorkerSpec.load(path)
    launched = unlaunched.model_copy(update={"master_url": "http://127.0.0.1:9"})
    assert WorkerSpec.load(launched.save(path)).master_url == "http://127.0.0.1:9"


def _result(**over) -> dict:
    base = dict(
        world_size=2, steps=10, epochs=[0], samples_per_epoch=[640], loss_per_epoch=[0.5], final_loss=0.5, wall_s=3.0,
        train_wall_s=2.0, samples_per_s=320.0, batch_size=32, threads_per_worker=1, fused_embeddings=True,
        sharding_plan={"C1": {"sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [0]}},
        checkpoint_dir="/out/ckpt", probe={"shard": 0, "row_start": 0, "row_end": 64}, generation=1,
        resumed_from={"path": "/out/ckpt/steps/5", "step": 5, "source": "disk", "saved_by_generation": 0,
                      "saved_at_world_size": 2, "skipped": [["/out/ckpt/steps/9", "torn"]]},
        checkpoints={"checkpoints": 2, "kind": "disk", "stall_s_median": 0.1, "stall_s": [0.1, 0.1]},
        grad_accumulation=1, micro_batch_size=32, rows_per_rank_step=32, global_batch=64, rap=None,
    )
    return {**base, **over}


def test_worker_result_round_trip(tmp_path):
    result = WorkerResult.model_validate(_result(final_loss=float("nan")))
    path = result.save(tmp_path / "worker")
    assert path == tmp_path / "worker" / RESULT_FILE and not list(path.parent.glob("*.tmp"))
    back = WorkerResult.load(tmp_path / "worker")
    assert back.model_dump_json() == result.model_dump_json()
    assert back.resumed_from.skipped == [("/out/ckpt/steps/9", "torn")] and back.sharding_plan["C1"].ranks == [0]
    assert '"final_loss": NaN' in path.read_text()  # as json.dumps wrote it before the model


@pytest.mark.parametrize("over, field", [
    (dict(samples_per_s="fast"), "samples_per_s"),
    (dict(checkpoints={"checkpoints": 1}), "checkpoints.kind"),
    (dict(probe={"shard": 0, "row_start": 0, "row_end": 1, "logits": []}), "probe.logits"),
    (dict(extra_key=1), "extra_key"),
])
def test_a_bad_worker_result_names_the_field(tmp_path, over, field):
    (tmp_path / RESULT_FILE).write_text(json.dumps(_result(**over)))
    pattern = r"result\.json does not hold a WorkerResult: .*" + re.escape(field)
    with pytest.raises(ValueError, match=pattern):
        WorkerResult.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="worker result not found"):
        WorkerResult.load(tmp_path / "nowhere")
