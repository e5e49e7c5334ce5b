"""The train task runs the prefetch depth the trigger form set (train.prefetch_steps) and records what ran: the
worker result's prefetch_steps and the train run's MLflow tag, the env override's value where that is set; likewise
train.sparse_dist_pipeline (TorchRec's TrainPipelineSparseDist in the step loop), train.prefetch_sched (the
prefetch thread's scheduling), resources.allocator (the ranks' allocators) and train.fused_interaction (the dot
interaction's C++ kernel, tag `interaction`) and train.rowwise_adagrad_kernel (tag `embedding_update`) and
train.dense_grad_exchange (tag `dense_sync`)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

CONF = {"rows_per_day": 1200, "rows_per_shard": 600, "seed": 3, "table_cap": 500, "preprocessing": "inline",
        "model": {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 1]},
        "resources": {"workers": 1, "policy": "static"}, "checkpoint": {"every_steps": 0, "flash": False}}


def _train(home, key: str, prefetch_steps: int, sparse_dist_pipeline: bool = False, **more):
    from recforge.pipelines.context import RunContext
    from recforge.pipelines.stages.data import generate, ingest
    from recforge.pipelines.stages.plan import plan_resources
    from recforge.pipelines.stages.train import train
    from recforge.tracking import TrackingStore
    from recforge.train.result import WorkerResult

    ctx = RunContext.create(key, {**CONF, "train": {"batch_size": 128, "log_every": 2, "batches_per_task": 2,
                                                    "prefetch_steps": prefetch_steps,
                                                    "sparse_dist_pipeline": sparse_dist_pipeline,
                                                    "prefetch_sched": more.get("prefetch_sched", "idle"),
                                                    "fused_interaction": more.get("fused_interaction", True),
                                                    "rowwise_adagrad_kernel": more.get("rowwise_adagrad_kernel",
                                                                                       True),
                                                    "dense_grad_exchange": more.get("dense_grad_exchange", True)},
                                "resources": {**CONF["resources"], "allocator": more.get("allocator", "kept")}},
                             home=home)
    generate(ctx)
    ingest(ctx)
    plan_resources(ctx)
    out = train(ctx)
    worker = WorkerResult.load(home / "runs" / "recforge_daily" / key / "train" / "worker")
    data = TrackingStore().client.get_run(out.mlflow_run_id).data
    return out, worker, data


def test_the_configured_depth_runs_and_the_override_is_what_is_recorded(recforge_home, monkeypatch):
    monkeypatch.delenv("RECFORGE_TRAIN_PREFETCH", raising=False)
    sync, worker, data = _train(recforge_home, "sync", 0, fused_interaction=False, rowwise_adagrad_kernel=False,
                                dense_grad_exchange=False)
    assert worker.prefetch_steps == 0 and sync.steps == 10  # 1200 rows in batches of 128
    assert (data.params["train.prefetch_steps"], data.tags["prefetch_steps"]) == ("0", "0")
    assert worker.sparse_dist_pipeline is False and data.tags["sparse_dist_pipeline"] == "false"
    assert worker.prefetch_sched is None and "prefetch_sched" not in data.tags  # no prefetch thread ran
    assert worker.allocator == "kept" and data.tags["allocator"] == "kept"  # the ranks' default allocator settings
    assert worker.interaction == "torchrec" and data.tags["interaction"] == "torchrec"  # the form switched it off
    assert data.params["train.fused_interaction"] == "False"
    assert worker.embedding_update == "fbgemm" and data.tags["embedding_update"] == "fbgemm"  # switched off too
    assert worker.dense_sync == "allreduce" and data.tags["dense_sync"] == "allreduce"

    monkeypatch.setenv("RECFORGE_TRAIN_PREFETCH", "1")  # the workers' override: what ran, not what was configured
    monkeypatch.delenv("RECFORGE_TRAIN_PIPELINE", raising=False)
    monkeypatch.delenv("RECFORGE_PREFETCH_SCHED", raising=False)
    monkeypatch.delenv("RECFORGE_ALLOCATOR", raising=False)
    # the trigger form's prefetch_sched and worker_allocator (config train.prefetch_sched, resources.allocator)
    ahead, worker, data = _train(recforge_home, "ahead", 3, sparse_dist_pipeline=True, prefetch_sched="normal",
                                 allocator="system")
    assert worker.prefetch_steps == 1 and ahead.steps == sync.steps
    assert worker.prefetch_sched == "normal" and data.tags["prefetch_sched"] == "normal"
    assert worker.allocator == "system" and data.tags["allocator"] == "system"
    # recforge's kernel by default, inside TorchRec's pipeline too (its fx trace records the torch path)
    assert worker.interaction == "cpp" and data.tags["interaction"] == "cpp"
    assert worker.embedding_update == "cpp" and data.tags["embedding_update"] == "cpp"  # row-wise Adagrad kernel
    # one rank: nothing to exchange with, DDP's own path (tests/integration/test_train_distributed.py: 2 ranks)
    assert worker.dense_sync == "allreduce" and data.tags["dense_sync"] == "allreduce"
    assert (data.params["train.prefetch_steps"], data.tags["prefetch_steps"]) == ("3", "1")
    # the trigger form's sparse_dist_pipeline ran TorchRec's TrainPipelineSparseDist over the prefetched steps
    assert worker.sparse_dist_pipeline is True and data.tags["sparse_dist_pipeline"] == "true"
    assert data.params["train.sparse_dist_pipeline"] == "True"
