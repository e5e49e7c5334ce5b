"""Per-step training time: fused FBGEMM TBE (optimizer applied in backward) vs the plain EBC kernel
with a regular optimizer, both as TorchRec DMP models with the same tables, batches and optimizer math.

  fused_tbe   table_wise sharding, FUSED kernel: embedding rows updated inside backward by FBGEMM's
              exact row-wise Adagrad; no embedding gradient is materialized.
  plain_ebc   data_parallel sharding, DENSE kernel (the only sharding torchrec 1.8 allows it with):
              full dense gradient of every table, then torchrec.optim.RowWiseAdagrad in Python.

Same DLRM (recforge.train.model.build_dlrm), same synthetic batches (Zipf-like ids, preprocessing
excluded), same loss code as the trainer. Each repeat times --steps steps of one variant; variants
alternate within a repeat; the median per-step time over --repeats repeats is reported with the
ratio plain / fused. Threads fixed (--threads per rank). JSON to bench/results/.

    python bench/bench_embeddings.py                      # 1 rank, caps 20k and 100k rows per table
    python bench/bench_embeddings.py --world-size 2 --table-caps 100000
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform as py_platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "fused_tbe": dict(sharding="table_wise", fused_embeddings=True),
    "plain_ebc": dict(sharding="data_parallel", fused_embeddings=False),
}


def _quiet() -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")


def make_batches(tables, num_dense, batch_size, n, seed):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = np.stack([(rng.zipf(1.15, batch_size) - 1) % rows for _, rows in tables], axis=1)
        kjt = KeyedJaggedTensor(
            keys=[t for t, _ in tables], values=torch.from_numpy(ids.T.reshape(-1).astype(np.int64)),
            lengths=torch.ones(batch_size * len(tables), dtype=torch.int32), stride=batch_size,
        )
        dense = torch.from_numpy(rng.normal(size=(batch_size, num_dense)).astype(np.float32))
        labels = torch.from_numpy((rng.random(batch_size) < 0.25).astype(np.float32))
        out.append((dense, kjt, labels, torch.ones(batch_size)))
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    _quiet()
    from recforge.config import ModelConfig, TrainConfig, criteo_kaggle_dataset
    from recforge.train.loop.loss import step_loss
    from recforge.train.model import build_dlrm
    from recforge.train.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ds = criteo_kaggle_dataset()
    model_cfg = ModelConfig()
    results = []
    try:
        for cap in args.table_caps:
            tables = [(f.name, min(f.cardinality, cap)) for f in ds.sparse]
            batches = make_batches(tables, len(ds.dense), args.batch_size, 8, seed=1000 * rank + cap)
            global_weight = float(args.batch_size * world)
            models = {}
            for name, kw in VARIANTS.items():
                torch.manual_seed(0)
                train = TrainConfig(batch_size=args.batch_size, **kw)
                models[name] = shard_model(build_dlrm(model_cfg, tables, len(ds.dense)), train, world_size=world,
                                           device=torch.device("cpu"))

            def run(sm, steps, batches=batches, global_weight=global_weight):  # this iteration's data
                for k in range(steps):
                    dense, kjt, labels, w = batches[k % len(batches)]
                    loss, _ = step_loss(sm.model(dense, kjt), labels, w, global_weight, world)
                    loss.backward()
                    sm.optimizer.step()
                    sm.optimizer.zero_grad()

            for sm in models.values():
                run(sm, args.warmup)
            times = {name: [] for name in models}
            for r in range(args.repeats):
                order = list(models) if r % 2 == 0 else list(reversed(list(models)))
                for name in order:
                    dist.barrier()
                    t0 = time.perf_counter()
                    run(models[name], args.steps)
                    dist.barrier()
                    times[name].append((time.perf_counter() - t0) / args.steps)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            results.append({
                "table_cap": cap,
                "embedding_rows": sum(r for _, r in tables),
                "embedding_mbytes": sum(r for _, r in tables) * model_cfg.embedding_dim * 4 / 2**20,
                "per_step_s": times,
                "median_step_s": med,
                "samples_per_s": {n: args.batch_size * world / m for n, m in med.items()},
                "plain_over_fused": med["plain_ebc"] / med["fused_tbe"],
                "plans": {n: sorted({(v["sharding_type"], v["compute_kernel"]) for v in sm.plan_summary().values()})
                          for n, sm in models.items()},
            })
            del models
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table-caps", type=int, nargs="+", default=[20_000, 100_000],
                   help="rows per table: min(Criteo Kaggle cardinality, cap)")
    p.add_argument("--batch-size", type=int, default=512, help="per rank")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "bench_embeddings.json")
    args = p.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".part")
    mp.spawn(_worker, args=(args.world_size, port, args, str(tmp)), nprocs=args.world_size)
    results = json.loads(tmp.read_text())
    tmp.unlink()

    import fbgemm_gpu  # noqa: F401  (version for the record)
    import torchrec

    print(f"DLRM criteo_kaggle tables, dim 16, batch {args.batch_size}/rank, world size {args.world_size}, "
          f"{args.threads} thread(s)/rank, median of {args.repeats} x {args.steps} steps")
    print(f"{'table cap':>10} {'emb MiB':>8} {'fused_tbe ms':>13} {'plain_ebc ms':>13} {'plain/fused':>12} "
          f"{'fused samples/s':>16}")
    for r in results:
        m = r["median_step_s"]
        print(f"{r['table_cap']:>10} {r['embedding_mbytes']:>8.0f} {m['fused_tbe'] * 1e3:>13.2f} "
              f"{m['plain_ebc'] * 1e3:>13.2f} {r['plain_over_fused']:>11.2f}x {r['samples_per_s']['fused_tbe']:>16.0f}")
    record = {
        "bench": "embeddings", "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "host": {"machine": py_platform.machine(), "cpus": os.cpu_count(), "python": py_platform.python_version()},
        "versions": {"torch": torch.__version__, "torchrec": torchrec.__version__,
                     "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?")},
        "variants": {k: dict(v) for k, v in VARIANTS.items()},
        "results": results,
    }
    args.out.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
