"""A table-batched embedding bag trained with exact row-wise Adagrad, forward + backward (the update applied in
backward), side by side: FBGEMM's SplitTableBatchedEmbeddingBagsCodegen as TorchRec's fused tables run it on a CPU,
and the same module with recforge's C++ lookup and update (recforge_kernels.rowwise_adagrad).

The default shape is one rank's share of the 2-rank DLRM benchmark (bench_train_peer): 13 tables of 100,000 rows x
16, a global batch of 1,024 rows, one id per bag. Both modules start from the same weights and see the same ids and
gradients each call; after the warm-up their weights and momentum are compared (a side that disagrees fails the
run). One process, `--threads` intra-op threads; rounds interleave the sides; medians of the per-call times and
FBGEMM's time over recforge's.

    python bench/bench_rowwise_adagrad.py --rounds 7
    recforge bench rowwise_adagrad -- --tables 26 --rows 20000
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import psutil
import torch
from rich.progress import Progress

from _results import cpu_model, time_forward_backward, write_report  # bench/_results.py

RESULTS = Path(__file__).resolve().parent / "results"
SIDES = ("fbgemm", "recforge")


def make_module(side: str, tables: int, rows: int, dim: int, lr: float) -> Any:
    """FBGEMM's module (seeded, so both sides start equal), with recforge's kernels installed for side recforge."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from recforge_kernels import rowwise_adagrad as ra

    torch.manual_seed(0)
    tbe = SplitTableBatchedEmbeddingBagsCodegen([(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
                                                optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr,
                                                eps=1e-8)
    if side == "recforge" and not ra.install(tbe):
        raise RuntimeError(f"recforge's kernels cannot serve the module: {ra.unsupported(tbe)}")
    return tbe


def time_side(tbe: Any, batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Median seconds of forward and backward (with the update) over the batches."""
    return time_forward_backward(batches, lambda b: tbe(b[0], b[1]), lambda b, out: out.backward(b[2]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=13)
    ap.add_argument("--rows", type=int, default=100_000, help="rows per table")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1024, help="bags per table per call (one id each)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=40, help="timed calls per side and round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_rowwise_adagrad.json")
    args = ap.parse_args(argv)
    if min(args.tables, args.rows, args.dim, args.batch, args.rounds, args.calls, args.threads) < 1:
        ap.error("--tables, --rows, --dim, --batch, --rounds, --calls and --threads must be >= 1")
    if args.dim % 4:
        ap.error(f"--dim must be a multiple of 4 (FBGEMM's tables), got {args.dim}")
    need = 2 * 2 * args.tables * args.rows * args.dim * 4  # two sides, weights + momentum (with margin)
    available = psutil.virtual_memory().available
    if need > 0.8 * available:
        ap.error(f"{args.tables} tables of {args.rows:,} x {args.dim} on both sides need ~{need / 2**30:.1f} GiB, "
                 f"beyond 80% of the {available / 2**30:.1f} GiB available")
    torch.set_num_threads(args.threads)
    modules = {s: make_module(s, args.tables, args.rows, args.dim, lr=0.01) for s in SIDES}
    g = torch.Generator().manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        indices = torch.randint(0, args.rows, (args.tables * args.batch,), generator=g)
        offsets = torch.arange(args.tables * args.batch + 1)
        return indices, offsets, torch.randn(args.batch, args.tables * args.dim, generator=g) * 0.01

    warm = [batch() for _ in range(5)]
    for s in SIDES:
        time_side(modules[s], warm)
    a, b = modules["fbgemm"], modules["recforge"]
    try:  # the same state after the same steps, to float rounding
        torch.testing.assert_close(b.weights_host, a.weights_host, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b.momentum1_host, a.momentum1_host, rtol=1e-4, atol=1e-9)
    except AssertionError as e:
        print(f"recforge's update differs from FBGEMM's: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    rounds: list[dict[str, Any]] = []
    with Progress() as bar:
        task = bar.add_task("rounds", total=args.rounds * len(SIDES))
        for _ in range(args.rounds):
            batches = [batch() for _ in range(args.calls)]
            rounds.append({})
            for s in SIDES:
                rounds[-1][s] = time_side(modules[s], batches)
                bar.advance(task)
    median = {s: {k: statistics.median(r[s][k] for r in rounds) for k in ("forward_s", "backward_s", "total_s")}
              for s in SIDES}
    speedup = {k: median["fbgemm"][k] / median["recforge"][k] for k in ("forward_s", "backward_s", "total_s")}
    report = {"bench": "rowwise_adagrad",
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "rounds": rounds, "median": median, "speedup_vs_fbgemm": speedup}
    for s, m in median.items():
        print(f"{s:9s} forward {m['forward_s'] * 1e3:7.3f} ms  backward + update {m['backward_s'] * 1e3:7.3f} ms  "
              f"total {m['total_s'] * 1e3:7.3f} ms")
    print(f"recforge / fbgemm speedup: forward {speedup['forward_s']:.2f}x, backward {speedup['backward_s']:.2f}x, "
          f"total {speedup['total_s']:.2f}x")
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
