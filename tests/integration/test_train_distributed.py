"""Distributed training end to end (2 gloo ranks on CPU).

1. One DMP step per sharding type, with uneven padded batches and a rank without data, equals a
   plain single-process step on the union of the real rows (exact loss normalization).
2. A 2-worker job through recforge.elastic.run_training_job on generated Criteo-like data: every
   row trained once per epoch, held-out AUC near the generator's Bayes ceiling, and the world-size-2
   DCP checkpoint loaded unsharded in this (single) process predicts what the workers predicted.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from recforge.elastic.backends.local import free_port

pytestmark = pytest.mark.slow

# ---------------------------------------------------------------------------------------------
# 1. distributed step == single-process step
# ---------------------------------------------------------------------------------------------
TABLES = [("C1", 60), ("C2", 400), ("C3", 9), ("C4", 1000)]
NUM_DENSE = 3
# (sharding, fused_embeddings, recforge's kernels): the last case keeps FBGEMM's backward for the fused tables and
# DDP's allreduce (train.rowwise_adagrad_kernel and train.dense_grad_exchange off)
CASES = [("table_wise", True, True), ("column_wise", True, True), ("data_parallel", False, True),
         ("data_parallel", True, True), ("auto", True, True), ("table_wise", True, False)]
STEPS = [  # real rows of rank 0 and rank 1 per step (batch size 8; rank 1 has no data in step 2)
    ((0, 8), (8, 11)),
    ((11, 17), (17, 17)),
]
BATCH = 8


def _model_cfg():
    from recforge.config import ModelConfig

    return ModelConfig(arch="dlrm_dcn", embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1])


def _data(n=17, seed=5):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, NUM_DENSE, generator=g)
    ids = torch.stack([torch.randint(0, r, (n,), generator=g) for _, r in TABLES], 1)
    labels = (torch.rand(n, generator=g) < 0.4).float()
    return dense, ids, labels


def _kjt(ids):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    b, f = ids.shape
    return KeyedJaggedTensor(keys=[t for t, _ in TABLES], values=ids.t().reshape(-1).contiguous(),
                             lengths=torch.ones(b * f, dtype=torch.int32), stride=b)


def _padded(sl):
    dense, ids, labels = _data()
    d, i, y = dense[sl], ids[sl], labels[sl]
    pad = BATCH - d.shape[0]
    w = torch.cat([torch.ones(d.shape[0]), torch.zeros(pad)])
    return (torch.cat([d, torch.zeros(pad, NUM_DENSE)]),
            torch.cat([i, torch.zeros(pad, len(TABLES), dtype=torch.long)]),
            torch.cat([y, torch.zeros(pad)]), w)


def _step_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    from recforge.config import TrainConfig
    from recforge.train.loop.loss import step_loss
    from recforge.train.model import build_dlrm
    from recforge.train.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        probe_dense, probe_ids, _ = _data()
        for sharding, fused, kernel in CASES:
            torch.manual_seed(0)
            model = build_dlrm(_model_cfg(), TABLES, NUM_DENSE, fused=True)  # the trainer's modules
            train = TrainConfig(sharding=sharding, fused_embeddings=fused, embedding_lr=0.2, dense_lr=0.1,
                                rowwise_adagrad_kernel=kernel, dense_grad_exchange=kernel)
            sm = shard_model(model, train, world_size=world, device=torch.device("cpu"), dense_optimizer="sgd")
            for ranges in STEPS:
                a, b = ranges[rank]
                d, i, y, w = _padded(slice(a, b))
                total = float(sum(e - s for s, e in ranges))
                loss, _ = step_loss(sm.model(d, _kjt(i)), y, w, total, world)
                loss.backward()
                sm.optimizer.step()
                sm.optimizer.zero_grad()
            with torch.no_grad():
                pred = sm.model(probe_dense[:16], _kjt(probe_ids[:16]))
            if rank == 0:
                torch.save({"pred": pred, "plan": sm.plan_summary(), "update": sm.embedding_update,
                            "sync": sm.dense_sync},
                           Path(out_dir) / f"{sharding}-{int(fused)}-{int(kernel)}.pt")
    finally:
        dist.destroy_process_group()


def _reference_predictions():
    """Plain model, same optimizers (RowWiseAdagrad embeddings, SGD dense), mean BCE over each step's real rows."""
    import torch.nn.functional as F

    from recforge.train.model import build_dlrm
    from recforge.train.sharding import EMBEDDING_OPTIMIZERS, _optimizer_kwargs

    torch.manual_seed(0)
    model = build_dlrm(_model_cfg(), TABLES, NUM_DENSE)
    emb = [p for n, p in model.named_parameters() if "embedding_bags" in n]
    dense_p = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    opts = [EMBEDDING_OPTIMIZERS["rowwise_adagrad"](emb, **_optimizer_kwargs("rowwise_adagrad", 0.2)),
            torch.optim.SGD(dense_p, lr=0.1)]
    dense, ids, labels = _data()
    for ranges in STEPS:
        rows = torch.cat([torch.arange(a, b) for a, b in ranges])
        F.binary_cross_entropy_with_logits(model(dense[rows], _kjt(ids[rows])).squeeze(1), labels[rows]).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    with torch.no_grad():
        return model(dense[:16], _kjt(ids[:16]))


def test_distributed_steps_equal_single_process_steps(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_step_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ref = _reference_predictions()
    torch.manual_seed(0)
    from recforge.train.model import build_dlrm

    with torch.no_grad():
        dense, ids, _ = _data()
        init = build_dlrm(_model_cfg(), TABLES, NUM_DENSE)(dense[:16], _kjt(ids[:16]))
    assert (ref - init).abs().max() > 1e-2  # the two steps moved the predictions
    for sharding, fused, kernel in CASES:
        got = torch.load(tmp_path / f"{sharding}-{int(fused)}-{int(kernel)}.pt")
        kinds = {(v["sharding_type"], v["compute_kernel"]) for v in got["plan"].values()}
        if sharding != "auto":
            assert {k[0] for k in kinds} == {sharding}
        if not fused:
            assert {k[1] for k in kinds} == {"dense"}
        # recforge's row-wise Adagrad kernel updates every fused table when on, FBGEMM's when off
        has_fused = any(k[1] == "fused" for k in kinds)
        assert got["update"] == ("none" if not has_fused else "cpp" if kernel else "fbgemm"), (sharding, fused, kernel)
        # the dense gradients: one all_to_all exchange on this 2-rank gloo group when on, DDP's allreduce when off
        assert got["sync"] == ("exchange" if kernel else "allreduce"), (sharding, fused, kernel)
        torch.testing.assert_close(got["pred"], ref, rtol=1e-4, atol=1e-5,
                                   msg=f"{sharding} fused={fused} kernel={kernel}")


# ---------------------------------------------------------------------------------------------
# 2. a 2-worker job through the job master
# ---------------------------------------------------------------------------------------------
ROWS_PER_DAY = 50_000
TABLE_CAP = 20_000


@pytest.fixture(scope="module")
def job(tmp_path_factory, mlflow_db):
    from recforge.config import ModelConfig, ResourceConfig, TrainConfig, dataset_preset
    from recforge.data.generator import generate_days
    from recforge.data.ingest import ingest
    from recforge.data.manifest import Manifest
    from recforge.elastic.backends.local import LocalBackend
    from recforge.elastic.job import run_training_job
    from recforge.elastic.policy import StaticPolicy
    from recforge.preprocess.planning.plan import criteo_plan
    from recforge.tracking.store import TrackingStore

    root = tmp_path_factory.mktemp("train_job")
    store = TrackingStore(tracking_uri=mlflow_db(root / "mlflow.db"), artifact_root=root / "artifacts")
    run_id = store.stage_run("recforge-train-test", "run-1", "train")
    ds = dataset_preset("criteo_kaggle")
    report = generate_days(ds, root / "raw", days=2, rows_per_day=ROWS_PER_DAY, seed=11)
    ingest([root / "raw" / "day_0.tsv"], ds, root / "train", rows_per_shard=20_000, max_bad_fraction=0.01)
    ingest([root / "raw" / "day_1.tsv"], ds, root / "holdout", rows_per_shard=20_000, max_bad_fraction=0.01)
    plan = criteo_plan(ds, TABLE_CAP)
    plan.save(root / "plan.json")
    model_cfg = ModelConfig()
    train = TrainConfig(epochs=1, batch_size=256, embedding_lr=0.05, dense_lr=0.002, batches_per_task=4, log_every=25)
    manifest = Manifest.load(root / "train")
    spec = {
        "manifest_dir": str(root / "train"), "plan_path": str(root / "plan.json"),
        "dataset": ds.model_dump(mode="json"), "model": model_cfg.model_dump(mode="json"),
        "train": train.model_dump(mode="json"), "checkpoint_dir": str(root / "ckpt"),
        "output_dir": str(root / "out"), "seed": 0, "tracking_uri": store.tracking_uri, "mlflow_run_id": run_id,
    }
    resources = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=0)
    result = run_training_job(
        spec, [s.rows for s in manifest.shards], resources=resources, state_dir=root / "job",
        policy=StaticPolicy(resources), backend=LocalBackend(max_restarts=0, log_dir=root / "job"),
        resume=False, timeout_s=300,
    )
    return {
        "root": root, "ds": ds, "plan": plan, "model_cfg": model_cfg, "train": train, "manifest": manifest,
        "report": report, "result": result, "store": store, "run_id": run_id,
        "worker": json.loads((root / "out" / "result.json").read_text()),
    }


def test_every_row_is_trained_once_per_epoch(job):
    worker, manifest, train = job["worker"], job["manifest"], job["train"]
    assert job["result"].finished
    assert manifest.total_rows == ROWS_PER_DAY
    assert worker["samples_per_epoch"] == [manifest.total_rows] * train.epochs
    assert job["result"].samples == manifest.total_rows * train.epochs  # the master's count agrees
    assert worker["world_size"] == 2
    # two ranks in lockstep: at least ceil(rows / (2 * batch)) steps per epoch
    assert worker["steps"] >= train.epochs * math.ceil(manifest.total_rows / (2 * train.batch_size))
    assert worker["samples_per_s"] > 0 and math.isfinite(worker["final_loss"])


def test_the_preprocessing_path_that_ran_is_recorded_and_native(job):
    # CPU, C++ kernels built: the criteo plan runs as one fused_chain call per batch; a silent fallback fails here
    ex = job["worker"]["executor"]
    assert (ex["requested"], ex["path"], ex["native_kernels"]) == ("fused", "cpp_single_pass", True)
    assert 0 < ex["detail"]["batches"]["cpp_single_pass"] <= job["worker"]["steps"]  # rank 0's training batches


def test_rank0_logs_training_metrics_to_mlflow(job):
    client, run_id, log_every = job["store"].client, job["run_id"], job["train"].log_every
    loss = client.get_metric_history(run_id, "train_loss")
    sps = client.get_metric_history(run_id, "samples_per_s")
    # rank 0 only, once per window, and the trailing part-window at the last step (so the curve ends there)
    steps = job["worker"]["steps"]
    want = [log_every * (i + 1) for i in range(steps // log_every)] + ([steps] if steps % log_every else [])
    assert loss and len(loss) == len(sps) == len(want)
    assert [m.step for m in loss] == want
    assert all(math.isfinite(m.value) and m.value > 0 for m in loss + sps)
    final = client.get_metric_history(run_id, "final_train_loss")
    assert len(final) == 1 and final[0].value == pytest.approx(job["worker"]["final_loss"])


def test_embeddings_are_sharded_over_both_ranks(job):
    plan = job["worker"]["sharding_plan"]
    assert sorted(plan) == sorted(name for name, _ in job["plan"].tables())
    ranks = {r for v in plan.values() for r in v["ranks"]}
    assert ranks == {0, 1}
    assert any(v["sharding_type"] in ("table_wise", "column_wise") and v["compute_kernel"] == "fused"
               for v in plan.values())


def test_world_size_2_checkpoint_loads_unsharded_with_the_trained_weights(job):
    from recforge.data.shards import read_rows
    from recforge.preprocess.batch import RawBatch
    from recforge.preprocess.executor import TorchExecutor
    from recforge.train.recovery.checkpoint import load_unsharded, read_meta

    root, plan = job["root"], job["plan"]
    assert read_meta(root / "ckpt")["world_size"] == 2
    model = load_unsharded(job["model_cfg"], plan.tables(), len(plan.dense_features()), root / "ckpt")
    probe = torch.load(root / "out" / "probe.pt")
    rows = read_rows(root / "train", probe["shard"], probe["row_start"], probe["row_end"])
    raw = RawBatch.from_arrow(rows, job["ds"])
    with torch.no_grad():
        dense, kjt = TorchExecutor(plan, job["ds"])(raw)
        logits = model(dense, kjt).reshape(-1)
    assert logits.shape == probe["logits"].shape == (job["train"].batch_size,)
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-5, atol=1e-5)
    torch.manual_seed(123)  # an untrained model predicts differently: the weights came from the checkpoint
    from recforge.train.model import build_dlrm

    with torch.no_grad():
        fresh = build_dlrm(job["model_cfg"], plan.tables(), len(plan.dense_features()))(dense, kjt).reshape(-1)
    assert (fresh - probe["logits"]).abs().max() > 1e-2


def test_held_out_auc_approaches_the_bayes_ceiling(job):
    from recforge.preprocess.executor import TorchExecutor
    from recforge.train.metrics import evaluate
    from recforge.train.recovery.checkpoint import load_unsharded

    root, plan = job["root"], job["plan"]
    model = load_unsharded(job["model_cfg"], plan.tables(), len(plan.dense_features()), root / "ckpt")
    metrics = evaluate(model, TorchExecutor(plan, job["ds"]), root / "holdout", batch_size=4096)
    ceiling = job["report"].bayes_auc[1]
    print(f"held-out AUC {metrics['auc']:.4f}, Bayes ceiling {ceiling:.4f}, NE {metrics['ne']:.4f}, "
          f"train samples/s {job['worker']['samples_per_s']:.0f}")
    assert metrics["rows"] == ROWS_PER_DAY
    assert metrics["auc"] > 0.6
    assert metrics["auc"] >= 0.5 + 0.6 * (ceiling - 0.5)
    assert metrics["ne"] < 1.0
