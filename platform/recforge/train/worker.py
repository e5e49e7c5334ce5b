"""Training worker: `python -m recforge.train.worker SPEC_JSON`, one process per rank under torchrun.

Reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the environment (without them
it runs as a single rank), trains the spec's DLRM with DMP over the job master's data-shard tasks,
writes a DCP checkpoint to spec.checkpoint_dir, and on rank 0 output_dir/result.json + probe.pt.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recforge.train.spec import WorkerSpec

log = logging.getLogger("recforge.train.worker")

RESULT_FILE = "result.json"
PROBE_FILE = "probe.pt"


def _env() -> tuple[int, int, int]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if "MASTER_ADDR" not in os.environ:
        if world != 1:
            raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is not set: launch under torch.distributed.run")
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    return rank, world, local


def _metrics_sink(spec: WorkerSpec):
    """An AsyncMetricsSink bound to the spec's MLflow run, or None (no run id / no tracking module)."""
    from recforge.train.metrics_sink import AsyncMetricsSink, tracking_log_fn

    if not spec.mlflow_run_id:
        return None
    fn = tracking_log_fn()
    return AsyncMetricsSink(fn, spec.tracking_uri, spec.mlflow_run_id) if fn is not None else None


def run(spec: WorkerSpec, rank: int, world_size: int, device: torch.device) -> dict[str, Any] | None:
    from recforge.elastic.client import MasterClient
    from recforge.preprocess.executor import make_executor
    from recforge.preprocess.plan import Plan
    from recforge.train.batches import TaskBatches, empty
    from recforge.train.checkpoint import save_checkpoint
    from recforge.train.loop import Heartbeat, LoopState, train_epoch
    from recforge.train.model import build_dlrm
    from recforge.train.probe import probe_logits
    from recforge.train.sharding import shard_model

    t_start = time.perf_counter()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and rank == 0:
        log.warning("restart %d of the worker group: the model starts again from its initial weights; the job "
                    "master hands out only the data not yet done", restart)
    plan = Plan.load(spec.plan_path)
    tables, num_dense = plan.tables(), len(plan.dense_features())
    torch.manual_seed(spec.seed)
    model = build_dlrm(spec.model, tables, num_dense, device)
    sharded = shard_model(model, spec.train, world_size=world_size, device=device)
    executor = make_executor(spec.preprocess_executor, plan, spec.dataset)  # PipelineConfig.preprocess_executor
    bs = spec.train.batch_size
    zero_batch = empty(spec.dataset, bs, executor, device)

    client = MasterClient(spec.master_url, worker_id=f"rank{rank}-{os.getpid()}")
    start = torch.tensor([client.epoch_state()["epoch"] if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(start, src=0)  # every rank runs the same epochs
    heartbeat = Heartbeat(client, interval_s=min(10.0, spec.train.lease_timeout_s / 4))
    sink = _metrics_sink(spec) if rank == 0 else None
    if sink is not None:  # connect to the tracking store before the clock starts
        sink.log_now({"world_size": float(world_size), "batch_size": float(bs)}, 0)
    state = LoopState()
    t_train = time.perf_counter()
    for epoch in range(int(start.item()), spec.train.epochs):
        client.epoch = epoch
        source = TaskBatches(client, spec.manifest_dir, spec.dataset, executor, bs, device)
        train_epoch(
            sharded, source, zero_batch, state, epoch=epoch, world_size=world_size,
            log_every=spec.train.log_every, heartbeat=heartbeat, sink=sink, rank=rank,
        )
    train_wall = time.perf_counter() - t_train
    client.close()

    probe = probe_logits(sharded.model, spec.manifest_dir, spec.dataset, executor, bs, device)
    summary = sharded.plan_summary()
    meta = {"world_size": world_size, "sharding_plan": summary, "model": spec.model.model_dump(mode="json"),
            "tables": tables, "num_dense": num_dense, "steps": state.step}
    save_checkpoint(sharded.model, sharded.optimizer, spec.checkpoint_dir, rank=rank, meta=meta)
    if rank != 0:
        return None
    samples = sum(e.samples for e in state.epochs)
    result = {
        "world_size": world_size,
        "steps": state.step,
        "epochs": [e.epoch for e in state.epochs],
        "samples_per_epoch": [e.samples for e in state.epochs],
        "loss_per_epoch": [e.loss for e in state.epochs],
        "final_loss": state.epochs[-1].loss if state.epochs else None,
        "wall_s": time.perf_counter() - t_start,
        "train_wall_s": train_wall,
        "samples_per_s": samples / train_wall if train_wall > 0 else 0.0,
        "batch_size": bs,
        "threads_per_worker": spec.threads_per_worker,
        "fused_embeddings": spec.train.fused_embeddings,
        "sharding_plan": summary,
        "checkpoint_dir": str(spec.checkpoint_dir),
        "probe": {k: v for k, v in probe.items() if k != "logits"},
    }
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(probe, out / PROBE_FILE)
    if sink is not None:
        sink({"final_train_loss": result["final_loss"] or float("nan"), "train_samples_per_s": result["samples_per_s"]}, state.step)
        sink.close()
    tmp = out / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / RESULT_FILE)
    log.info("result: %s", json.dumps({k: result[k] for k in ("steps", "samples_per_epoch", "final_loss", "samples_per_s")}))
    return result


def _quiet_logs(rank: int) -> None:
    """Our INFO lines; only errors from torchrec / fbgemm (they log chatty INFO and benign warnings on root)."""
    logging.basicConfig(level=logging.ERROR, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("recforge").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
    # The data_parallel (DENSE) embedding kernel backprops through an fbgemm op registered without an
    # Autograd key; its gradients are checked against a single-process model in the integration tests.
    warnings.filterwarnings("ignore", message=r"fbgemm::dense_embedding_codegen_lookup_function")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m recforge.train.worker SPEC_JSON", file=sys.stderr)
        return 2
    rank, world_size, local_rank = _env()
    _quiet_logs(rank)
    spec = WorkerSpec.load(argv[0])
    torch.set_num_threads(spec.threads_per_worker)
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    try:
        run(spec, rank, world_size, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
