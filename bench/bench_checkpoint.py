"""Training stall per checkpoint: flash (shared memory) against torch.save and a synchronous DCP save.

Two gloo ranks (one thread each) hold a sharded DLRM (TorchRec DMP, fused TBE, Criteo-shaped tables
capped at --table-cap rows) after a few training steps, with optimizer state. Each method saves the
full training state (model + optimizer) --repeats times, side by side in one run; the stall is the
wall time both ranks are away from training (measured on rank 0 between barriers), median reported:

  flash (shm)          recforge.train.recovery.flash.FlashSnapshotter.save, fast path: every rank copies its tensors'
                       bytes into the layout of its first snapshot in /dev/shm (no collective, no pickling)
  flash first (shm)    the first snapshot of a group: a DCP save into /dev/shm that records the layout
  dcp sync (disk)      torch.distributed.checkpoint.save to disk, fsync (the default FileSystemWriter)
  recforge disk        recforge.train.recovery.resume.save_disk: DCP + sha256 checksums + rename (the no-agent path)
  torch.save (disk)    each rank torch.save()s its state_dict (local shards, pickled) + fsync
  torch.save no fsync  the same, left in the page cache

and, off the training path, how long the flash agent takes to persist one snapshot to disk. It also times
training steps of the same model at --batch-size rows per rank (model time only: no preprocessing, so a lower
bound of a pipeline step) and reports each method's overhead at one checkpoint every --every-steps steps
(default: the pipeline's CheckpointConfig.every_steps) as a share of training time.

    recforge bench checkpoint --table-cap 100000 --batch-size 512     # the pipeline's default sizes
    python bench/bench_checkpoint.py --table-cap 20000 --repeats 7
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform as py_platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

from recforge.elastic.backends.local import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 2


def _state_bytes(state) -> int:
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    total = 0

    def walk(x):
        nonlocal total
        if isinstance(x, ShardedTensor):
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in x.local_shards())
        elif isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return total


def _worker(rank: int, port: int, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from recforge.config import ModelConfig, TrainConfig, dataset_preset
    from recforge.elastic.agent.flash_checkpoint import FlashPersister
    from recforge.preprocess.planning.plan import criteo_plan
    from recforge.train.model import build_dlrm
    from recforge.train.recovery.flash import FlashSnapshotter
    from recforge.train.recovery.resume import save_disk, training_state
    from recforge.train.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    ds = dataset_preset("criteo_kaggle")
    plan = criteo_plan(ds, args["table_cap"])
    tables = plan.tables()
    torch.manual_seed(0)
    model_cfg = ModelConfig(embedding_dim=args["dim"], dense_arch=[64, args["dim"]], over_arch=[64, 32, 1])
    model = build_dlrm(model_cfg, tables, len(plan.dense_features()))
    sm = shard_model(model, TrainConfig(batch_size=64), world_size=WORLD, device=torch.device("cpu"))
    # a few steps so every optimizer state exists, then timed steps at the pipeline's batch size
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(rank)

    def batch(b):
        ids = torch.stack([torch.randint(0, n, (b,), generator=g) for _, n in tables], 1)
        kjt = KeyedJaggedTensor(keys=[t for t, _ in tables], values=ids.t().reshape(-1).contiguous(),
                                lengths=torch.ones(b * len(tables), dtype=torch.int32), stride=b)
        return torch.randn(b, len(plan.dense_features()), generator=g), kjt, (torch.rand(b, generator=g) < 0.3).float()

    def step(dense, kjt, labels):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(sm.model(dense, kjt).reshape(-1), labels)
        loss.backward()
        sm.optimizer.step()
        sm.optimizer.zero_grad()

    for _ in range(3):
        step(*batch(64))
    batches = [batch(args["batch_size"]) for _ in range(args["steps"])]
    step_times = []
    for b in batches:
        dist.barrier()
        t0 = time.perf_counter()
        step(*b)
        dist.barrier()
        step_times.append(time.perf_counter() - t0)
    local_bytes = _state_bytes(training_state(sm.model, sm.optimizer))
    sizes = [None] * WORLD
    dist.all_gather_object(sizes, local_bytes)

    disk = Path(args["disk_dir"])
    shm = Path(args["shm_dir"])

    snap = FlashSnapshotter(shm / "fast", rank)
    snap.save(sm.model, sm.optimizer, 1, {"step": 1, "world_size": WORLD})  # the first (full) one, not timed

    def m_flash(i):
        snap.save(sm.model, sm.optimizer, i + 2, {"step": i + 2, "world_size": WORLD})

    def m_flash_first(i):
        FlashSnapshotter(shm / f"first-{i}", rank).save(sm.model, sm.optimizer, 1, {"step": 1, "world_size": WORLD})

    def m_dcp(i):
        path = disk / f"dcp-{i}"
        dcp.save(training_state(sm.model, sm.optimizer), storage_writer=FileSystemWriter(str(path)))

    def m_recforge(i):
        save_disk(sm.model, sm.optimizer, disk / "steps", i + 1, rank=rank, meta={"step": i + 1, "world_size": WORLD},
                  keep=2)

    def torch_save(i, fsync):
        path = disk / f"torch-{i}-rank{rank}.pt"
        with open(path, "wb") as f:
            torch.save(training_state(sm.model, sm.optimizer), f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    methods = {
        "flash (shm)": m_flash,
        "flash first (shm)": m_flash_first,
        "dcp sync (disk)": m_dcp,
        "recforge disk": m_recforge,
        "torch.save (disk)": lambda i: torch_save(i, True),
        "torch.save no fsync": lambda i: torch_save(i, False),
    }
    times = {k: [] for k in methods}
    for i in range(args["repeats"]):  # interleaved: the machine's noise hits every method alike
        for name, fn in methods.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn(i)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
        if rank == 0:
            for p in disk.glob("dcp-*"):
                shutil.rmtree(p, ignore_errors=True)
            for p in disk.glob("torch-*.pt"):
                p.unlink()
        dist.barrier()
    persist = []
    if rank == 0:
        for _ in range(args["repeats"]):
            save_dir = Path(tempfile.mkdtemp(dir=disk))
            t0 = time.perf_counter()
            FlashPersister(shm / "fast", save_dir, keep=1).persist_now()
            persist.append(time.perf_counter() - t0)
            shutil.rmtree(save_dir, ignore_errors=True)
        Path(out).write_text(json.dumps({"times": times, "persist": persist, "state_bytes": sizes,
                                         "step_times": step_times,
                                         "fast_saves": snap.fast_saves, "full_saves": snap.full_saves}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table-cap", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--disk-dir", default=None, help="where disk checkpoints go (default: the system temp dir)")
    p.add_argument("--batch-size", type=int, default=512, help="rows per rank of a timed training step")
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--every-steps", type=int, default=None,
                   help="checkpoint cadence for the overhead column (default: the pipeline's checkpoint.every_steps)")
    args = p.parse_args()
    if args.every_steps is None:
        from recforge.config.pipeline import CheckpointConfig

        args.every_steps = CheckpointConfig().every_steps
    import torch.multiprocessing as mp

    if args.disk_dir:
        Path(args.disk_dir).mkdir(parents=True, exist_ok=True)
    disk = Path(tempfile.mkdtemp(prefix="recforge-ckpt-bench-", dir=args.disk_dir))
    shm = Path(tempfile.mkdtemp(prefix="recforge-bench-", dir="/dev/shm"))
    out = disk / "raw.json"
    try:
        worker_args = {"table_cap": args.table_cap, "dim": args.dim, "repeats": args.repeats, "disk_dir": str(disk),
                       "shm_dir": str(shm), "batch_size": args.batch_size, "steps": args.steps}
        mp.spawn(_worker, args=(free_port(), worker_args, str(out)), nprocs=WORLD)
        raw = json.loads(out.read_text())
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in raw["times"].items()}
    flash = med["flash (shm)"]
    total_mb = sum(raw["state_bytes"]) / 2**20
    print(f"training state: {total_mb:.1f} MiB over {WORLD} ranks "
          f"(tables capped at {args.table_cap} rows, dim {args.dim})")
    step_s = statistics.median(raw["step_times"])
    every = args.every_steps
    overhead = {k: v / (every * step_s) if every else 0.0 for k, v in med.items()}
    print(f"training step: {step_s * 1e3:.1f} ms median over {args.steps} steps of {args.batch_size} rows per rank; "
          f"overhead at one checkpoint every {every} steps:")
    print(f"{'method':24s} {'median stall s':>15s} {'x flash':>8s} {'MiB/s':>9s} {'overhead %':>11s}")
    for k, v in med.items():
        print(f"{k:24s} {v:15.4f} {v / flash:8.2f} {total_mb / v:9.0f} {100 * overhead[k]:10.2f}%")
    persist = statistics.median(raw["persist"])
    print(f"{'agent persist (async)':24s} {persist:15.4f} {persist / flash:8.2f} {total_mb / persist:9.0f}"
          "  (off the training path)")
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    doc = {
        "bench": "checkpoint", "time": stamp, "world_size": WORLD, "threads_per_rank": 1,
        "table_cap": args.table_cap, "embedding_dim": args.dim, "repeats": args.repeats,
        "state_mib": total_mb, "median_stall_s": med, "ratio_to_flash": {k: v / flash for k, v in med.items()},
        "agent_persist_median_s": persist, "raw": raw["times"], "machine": py_platform.platform(),
        "batch_size": args.batch_size, "step_s_median": step_s, "every_steps": every,
        "overhead_fraction": overhead, "step_times": raw["step_times"],
        "cpu_count": os.cpu_count(),
    }
    path = RESULTS / f"bench_checkpoint_{stamp}.json"
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
