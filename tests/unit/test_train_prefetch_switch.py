"""Training's prefetch depth is a trigger-form switch (Param prefetch_steps -> train.prefetch_steps -> the worker
spec), env RECFORGE_TRAIN_PREFETCH overrides it on a worker, and what ran is recorded (WorkerResult.prefetch_steps,
the train stage's MLflow tag)."""
from __future__ import annotations

import pytest

from recforge.config import PipelineConfig
from recforge.pipelines.dag_tasks import ParamError, config_from_params, default_params
from recforge.pipelines.stages.train import log_prefetch
from recforge.train.result import WorkerResult
from recforge.train.spec import WorkerSpec
from recforge.worker.trainer import PREFETCH_ENV, PREFETCH_SCHED_ENV, prefetch_depth, prefetch_sched


def _spec(cfg: PipelineConfig, tmp_path) -> WorkerSpec:
    """The spec as the train stage builds it (train=cfg.train), written and read back as a launched worker does."""
    spec = WorkerSpec(manifest_dir=tmp_path / "train", plan_path=tmp_path / "plan.json", dataset=cfg.dataset(),
                      model=cfg.model, train=cfg.train, checkpoint_dir=tmp_path / "ckpt", output_dir=tmp_path / "out",
                      master_url="http://127.0.0.1:9")
    return WorkerSpec.load(spec.save(tmp_path / "spec.json"))


@pytest.mark.parametrize("steps", [0, 5])
def test_the_param_reaches_the_worker(steps, tmp_path, monkeypatch):
    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    cfg = PipelineConfig.model_validate(config_from_params({"prefetch_steps": steps}))
    spec = _spec(cfg, tmp_path)
    assert spec.train.prefetch_steps == steps
    assert prefetch_depth(spec, corun=False) == steps
    assert prefetch_depth(spec, corun=True) == 0  # RAP's co-run source reads ahead itself


def test_the_default_is_four_and_a_bad_param_is_refused(tmp_path, monkeypatch):
    from airflow.sdk import Param
    from airflow.sdk.exceptions import ParamValidationError

    monkeypatch.delenv(PREFETCH_ENV, raising=False)
    spec = default_params()["prefetch_steps"]
    assert (spec["default"], spec["type"], spec["minimum"]) == (4, "integer", 0)
    assert prefetch_depth(_spec(PipelineConfig(), tmp_path), corun=False) == 4
    for bad in (-1, "two", 1.5):
        with pytest.raises(ParamValidationError):  # the trigger form
            Param(**spec).resolve(value=bad)
    with pytest.raises(ParamError, match=r"param 'prefetch_steps': must be >= 0, got -1"):  # a trigger's conf
        config_from_params({"prefetch_steps": -1})


def test_the_env_var_overrides_and_a_bad_value_names_it(tmp_path, monkeypatch):
    spec = _spec(PipelineConfig.model_validate({"train": {"prefetch_steps": 4}}), tmp_path)
    monkeypatch.setenv(PREFETCH_ENV, " 0 ")
    assert prefetch_depth(spec, corun=False) == 0
    monkeypatch.setenv(PREFETCH_ENV, "")  # set but empty: the spec's
    assert prefetch_depth(spec, corun=False) == 4
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv(PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=rf"RECFORGE_TRAIN_PREFETCH='{bad}': expected a step count >= 0"):
            prefetch_depth(spec, corun=False)
    assert prefetch_depth(spec, corun=True) == 0  # co-run: off whatever is asked


def _result(prefetch_steps: int | None) -> WorkerResult:
    return WorkerResult.model_validate(dict(
        world_size=1, steps=3, epochs=[0], samples_per_epoch=[96], loss_per_epoch=[0.6], wall_s=2.0,
        train_wall_s=1.0, samples_per_s=96.0, batch_size=32, threads_per_worker=1, fused_embeddings=True,
        sharding_plan={}, checkpoint_dir="/out/ckpt", probe={"shard": 0, "row_start": 0, "row_end": 32},
        generation=0, checkpoints={"checkpoints": 0, "kind": "disk", "stall_s": []}, grad_accumulation=1,
        micro_batch_size=32, rows_per_rank_step=32, global_batch=32,
        **({} if prefetch_steps is None else {"prefetch_steps": prefetch_steps})))


def test_the_result_records_the_depth(tmp_path):
    assert WorkerResult.load(_result(0).save(tmp_path / "a").parent).prefetch_steps == 0
    assert _result(None).prefetch_steps is None  # a result written before the field loads
    with pytest.raises(ValueError, match="prefetch_steps"):
        _result(-1)


def test_the_depth_that_ran_is_logged_and_a_retry_may_differ(recforge_home):
    """The param train.prefetch_steps is what was configured (4); the tag is the worker's (0: co-run, or the env
    override); a retried task whose workers ran another depth overwrites the tag instead of failing."""
    from recforge.tracking import TrackingStore

    store = TrackingStore()
    run_id = store.client.create_run(store.client.create_experiment("prefetch")).info.run_id
    store.log_params(run_id, {"train": PipelineConfig().train.model_dump(mode="json")})  # as the train stage does
    log_prefetch(store, run_id, _result(0))
    data = store.client.get_run(run_id).data
    assert data.params["train.prefetch_steps"] == "4" and data.tags["prefetch_steps"] == "0"
    log_prefetch(store, run_id, _result(3))  # the retry
    log_prefetch(store, run_id, _result(None))  # nothing recorded: the tag stays
    assert store.client.get_run(run_id).data.tags["prefetch_steps"] == "3"



def test_a_rescaled_retry_logs_its_shape_without_failing(recforge_home):
    """A retried train task whose job ended at another world size (DLRover-RM rescaled it) must not fail on MLflow's
    immutable params: the params keep the first attempt's shape, the tags say what this attempt ended with."""
    from recforge.pipelines.stages.train import _log_shape
    from recforge.tracking import TrackingStore

    store = TrackingStore()
    run_id = store.client.create_run(store.client.create_experiment("shape")).info.run_id
    _log_shape(store, run_id, _result(2))
    _log_shape(store, run_id, _result(2).model_copy(update={"world_size": 2, "steps": 5}))
    data = store.client.get_run(run_id).data
    assert (data.params["world_size"], data.params["steps"], data.params["batch_size"]) == ("1", "3", "32")
    assert (data.tags["world_size"], data.tags["steps"], data.tags["batch_size"]) == ("2", "5", "32")


def test_the_sparse_dist_pipeline_param_reaches_the_worker_and_the_env_overrides_it(tmp_path, monkeypatch):
    from recforge.worker.trainer import sparse_dist_pipeline

    monkeypatch.delenv("RECFORGE_TRAIN_PIPELINE", raising=False)
    assert default_params()["sparse_dist_pipeline"]["default"] is False
    assert sparse_dist_pipeline(_spec(PipelineConfig(), tmp_path), rank=0) is False
    on = _spec(PipelineConfig.model_validate(config_from_params({"sparse_dist_pipeline": True})), tmp_path)
    assert on.train.sparse_dist_pipeline and sparse_dist_pipeline(on, rank=0) is True
    monkeypatch.setenv("RECFORGE_TRAIN_PIPELINE", "0")
    assert sparse_dist_pipeline(on, rank=0) is False
    monkeypatch.setenv("RECFORGE_TRAIN_PIPELINE", "maybe")
    with pytest.raises(ValueError, match="RECFORGE_TRAIN_PIPELINE='maybe'"):
        sparse_dist_pipeline(on, rank=0)
    with pytest.raises(ParamError, match="sparse_dist_pipeline"):
        config_from_params({"sparse_dist_pipeline": "yes please"})


def test_the_prefetch_sched_param_reaches_the_worker_idle_by_default_and_the_env_overrides_it(tmp_path, monkeypatch):
    monkeypatch.delenv(PREFETCH_SCHED_ENV, raising=False)
    assert default_params()["prefetch_sched"]["default"] == "idle"
    assert default_params()["prefetch_sched"]["enum"] == ["idle", "normal"]
    idle = _spec(PipelineConfig(), tmp_path)
    assert prefetch_sched(idle) == "idle"
    normal = _spec(PipelineConfig.model_validate(config_from_params({"prefetch_sched": "normal"})), tmp_path)
    assert normal.train.prefetch_sched == "normal" and prefetch_sched(normal) == "normal"
    monkeypatch.setenv(PREFETCH_SCHED_ENV, "normal")
    assert prefetch_sched(idle) == "normal"
    monkeypatch.setenv(PREFETCH_SCHED_ENV, "fifo")
    with pytest.raises(ValueError, match="RECFORGE_PREFETCH_SCHED='fifo'"):
        prefetch_sched(idle)
    with pytest.raises(ParamError, match="prefetch_sched"):
        config_from_params({"prefetch_sched": "fifo"})
