"""RAP co-running: training throughput with three ways of preprocessing, side by side in one run (`recforge bench rap`).

  ideal    every batch preprocessed before training starts (RAP's "Ideal")
  inline   each batch preprocessed right before its step, on the training thread (RAP's "Sequential")
  corun    RAP: batch i+1's fused kernels run on the co-run thread, launched at the stage boundaries of step i
           (recforge.rap.runtime.corun_runtime), leftovers finished before step i+1

One process, one single-rank gloo group, the real trainer (recforge.train.loop.step_loop.train_epoch over TaskBatches /
CorunTaskBatches, a fixed task list standing in for the job master). The raw rows of each task are read from the
Parquet shards once, before timing, and served from memory (`--read-in-loop` reads them inside the loop instead),
so the variants differ only in preprocessing; the read cost per batch is reported on its own. Fixed thread
counts: the trainer `--threads`, the co-run thread `--corun-threads`. Rounds are interleaved (ideal, inline, corun,
ideal, ...) so machine noise spreads over all three; medians of samples/s per variant and ratios of medians. Per plan
it also measures the preprocessing share of a step: median fused-executor time of one batch, alone, over the median
ideal step time (RAP's case: preprocessing well under a step). Before timing, the three variants' per-step
losses over one epoch are compared (they must be equal: the same ids and values reach the model).

    python bench/bench_rap.py                                  # plans plan0,plan2: batch 4096, 12 steps, 5 rounds
    python bench/bench_rap.py --plans plan0,plan2,plan3 --rounds 9 --steps 8 --batches-per-task 4
    python bench/bench_rap.py --plans plan3 --rounds 3 --schedule my_schedule.json

Writes bench/results/bench_rap.json (temp + rename) and prints a table.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _results import write_report  # bench/_results.py (bench/ is the script's directory)
from recforge.config import ModelConfig, TrainConfig
from recforge.data.generator import generate_days
from recforge.data.ingest import ingest
from recforge.data.shards import read_rows
from recforge.elastic.master.tasks import Task
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import make_executor
from recforge.preprocess.presets import load_plan, preset_dataset
from recforge.preprocess.synth import random_raw_batch
from recforge.rap.planning.schedule import CorunSchedule, whole_kernel_schedule
from recforge.rap.runtime.corun_batches import CorunTaskBatches, PreprocessedBatches
from recforge.rap.runtime.session import CorunSession
from recforge.train.loop.batches import TaskBatches, slice_raw
from recforge.train.loop.step_loop import LoopState, PhaseTimes, train_epoch
from recforge.train.model import build_dlrm
from recforge.train.sharding import shard_model

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("ideal", "inline", "corun")


class RowsInMemory:
    """Mixin for TaskBatches: a task's raw rows come from `rows` ({shard: RawBatch}, read before timing)."""

    rows: dict[int, RawBatch] = {}

    def read_task(self, task) -> RawBatch:
        return slice_raw(self.rows[task.shard], task.row_start, task.row_end)


class MemTaskBatches(RowsInMemory, TaskBatches):
    pass


class MemCorunBatches(RowsInMemory, CorunTaskBatches):
    pass


class FixedTasks:
    """The job master's lease / done over a fixed list of tasks (one per shard)."""

    def __init__(self, shards: list[int], rows: list[int]) -> None:
        self.tasks = [Task(task_id=f"s{s}", epoch=0, shard=s, row_start=0, row_end=n)
                      for s, n in zip(shards, rows, strict=True)]

    def lease(self):
        return self.tasks.pop(0) if self.tasks else None

    def done(self, task_id: str, samples: int) -> bool:
        return True


def make_data(ds, rows: int, rows_per_shard: int, root: Path, seed: int) -> tuple[Path, list[int]]:
    generate_days(ds, root / "raw", days=1, rows_per_day=rows, seed=seed)
    manifest = ingest([root / "raw" / "day_0.tsv"], ds, root / "data", rows_per_shard=rows_per_shard,
                      max_bad_fraction=1.0)
    return root / "data", [s.rows for s in manifest.shards]


def run_epoch(variant: str, sharded, ctx: dict[str, Any], losses: list[float] | None = None,
              phases: PhaseTimes | None = None) -> tuple[float, int]:
    """One epoch over the data with `variant`; (seconds in the training loop, steps). `phases`: the step loop's
    phase timer (e.g. bench_rap_share.StepClock, which keeps every step's times)."""
    cpu = torch.device("cpu")
    client = FixedTasks(list(range(len(ctx["shard_rows"]))), ctx["shard_rows"])
    session = None
    mem = RowsInMemory.rows = ctx["rows_in_memory"]
    if variant == "corun":
        session = CorunSession(ctx["plan"], ctx["ds"], ctx["schedule"], sharded.model, cpu,
                               threads=ctx["corun_threads"], sharding=sharded.plan_summary(),
                               executor=ctx["corun_executor"])
        source = session.batches(client, ctx["manifest"], ctx["ds"], ctx["batch"], cpu,
                                 source_cls=CorunTaskBatches if mem is None else MemCorunBatches)
    else:
        source = (TaskBatches if mem is None else MemTaskBatches)(client, ctx["manifest"], ctx["ds"],
                                                                  ctx["executor"], ctx["batch"], cpu)
        if variant == "ideal":
            source = PreprocessedBatches(source)  # preprocessed here, outside the timed loop
    sink = (lambda m, step: losses.append(m["train_loss"])) if losses is not None else None
    stats = train_epoch(sharded, source, None, LoopState(), epoch=0, world_size=1, log_every=1 if sink else 10**9,
                        sink=sink, phases=phases)
    if session is not None:
        ctx.setdefault("corun_summaries", []).append(session.summary())
        session.close()
    return stats.wall_s, stats.steps


def preprocess_ms(executor, ds, batch: int, reps: int) -> float:
    raws = [random_raw_batch(ds, batch, seed=s) for s in range(2)]
    executor(raws[0])
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        executor(raws[i % 2])
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def read_ms_per_batch(manifest: Path, ds, shard_rows: list[int], batch: int) -> float:
    t = time.perf_counter()
    RawBatch.from_arrow(read_rows(manifest, 0, 0, shard_rows[0]), ds)
    return (time.perf_counter() - t) * 1e3 / max(1, -(-shard_rows[0] // batch))


def bench_plan(name: str, args, root: Path) -> dict[str, Any]:
    ds = preset_dataset(name)
    plan = load_plan(name, ds, args.table_cap)
    rows = args.batch * args.steps
    manifest, shard_rows = make_data(ds, rows, args.batch * args.batches_per_task, root / name, args.seed)
    executor = make_executor("fused", plan, ds)
    compiled = executor.compiled
    if args.schedule:
        schedule = CorunSchedule.from_json(Path(args.schedule).read_text())
        schedule_source = str(args.schedule)
    else:
        schedule = whole_kernel_schedule(compiled, args.stage)
        schedule_source = f"every fused kernel whole in stage {args.stage!r}"
    ctx = {"plan": plan, "ds": ds, "manifest": manifest, "shard_rows": shard_rows, "batch": args.batch,
           "executor": executor, "schedule": schedule, "corun_threads": args.corun_threads,
           "corun_executor": make_executor("fused", plan, ds, compiled=compiled),
           "rows_in_memory": None if args.read_in_loop else {
               i: RawBatch.from_arrow(read_rows(manifest, i, 0, n), ds) for i, n in enumerate(shard_rows)}}
    torch.manual_seed(args.seed)
    model_cfg = ModelConfig(arch=args.arch, embedding_dim=args.dim, dense_arch=[*args.dense_arch, args.dim],
                            over_arch=[*args.over_arch, 1])
    init = build_dlrm(model_cfg, plan.tables(), len(plan.dense_features()))
    state = {k: v.clone() for k, v in init.state_dict().items()}

    def fresh():
        m = build_dlrm(model_cfg, plan.tables(), len(plan.dense_features()))
        m.load_state_dict(state)
        return shard_model(m, TrainConfig(batch_size=args.batch, sharding=args.sharding), world_size=1,
                           device=torch.device("cpu"))

    # correctness first: from the same weights, one epoch per variant gives the same per-step losses
    curves = {}
    for v in VARIANTS:
        curves[v] = []
        run_epoch(v, fresh(), ctx, curves[v])
    same = all(curves[v] == curves["ideal"] for v in VARIANTS)
    sharded = fresh()  # throughput: one model trained on by every variant in turn
    for v in VARIANTS:
        run_epoch(v, sharded, ctx)  # warm-up
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    step_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ctx["corun_summaries"] = []
    for _ in range(args.rounds):
        for v in VARIANTS:
            wall, steps = run_epoch(v, sharded, ctx)
            samples[v].append(rows / wall)
            step_ms[v].append(wall / steps * 1e3)
    med = {v: statistics.median(samples[v]) for v in VARIANTS}
    ideal_step = statistics.median(step_ms["ideal"])
    prep = preprocess_ms(executor, ds, args.batch, reps=max(5, args.rounds * 2))
    read = read_ms_per_batch(manifest, ds, shard_rows, args.batch)
    corun_summary = ctx["corun_summaries"][len(ctx["corun_summaries"]) // 2]
    return {
        "plan": plan.name, "dense_features": len(plan.dense_features()), "sparse_features": len(plan.tables()),
        "fused_groups": len(compiled.groups), "schedule": schedule_source,
        "loss_curves_equal": same, "loss_steps": len(curves["ideal"]),
        "samples_per_s": {v: {"median": med[v], "rounds": samples[v]} for v in VARIANTS},
        "step_ms_median": {v: statistics.median(step_ms[v]) for v in VARIANTS},
        "ratios": {"corun_vs_ideal": med["corun"] / med["ideal"], "inline_vs_ideal": med["inline"] / med["ideal"],
                   "corun_vs_inline": med["corun"] / med["inline"]},
        "preprocess_ms_per_batch": prep, "read_ms_per_batch": read,
        "preprocess_share_of_ideal_step": prep / ideal_step,
        "corun": corun_summary, "raw_rows": "read in the loop" if args.read_in_loop else "in memory",
    }


def print_table(results: dict[str, Any]) -> None:
    print(f"{'plan':6s} {'ideal':>10s} {'inline':>10s} {'corun':>10s}   {'corun/ideal':>11s} {'inline/ideal':>12s} "
          f"{'corun/inline':>12s}  {'prep share':>10s}  losses")
    for name, r in results.items():
        s, q = r["samples_per_s"], r["ratios"]
        print(f"{name:6s} {s['ideal']['median']:10,.0f} {s['inline']['median']:10,.0f} {s['corun']['median']:10,.0f}   "
              f"{q['corun_vs_ideal']:11.3f} {q['inline_vs_ideal']:12.3f} {q['corun_vs_inline']:12.3f}  "
              f"{100 * r['preprocess_share_of_ideal_step']:9.1f}%  {'equal' if r['loss_curves_equal'] else 'DIFFER'}")
    print("(samples/s medians; prep share = fused preprocessing of one batch alone / ideal step time)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default="plan0,plan2")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12, help="steps per epoch (= rows / batch)")
    ap.add_argument("--batches-per-task", type=int, default=6, help="batches per task (one Parquet shard each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="the trainer's intra-op threads")
    ap.add_argument("--corun-threads", type=int, default=1, help="the co-run thread's intra-op threads")
    ap.add_argument("--table-cap", type=int, default=20_000)
    ap.add_argument("--arch", default="dlrm_dcn", choices=["dlrm", "dlrm_dcn"],
                    help="dlrm's pairwise interaction grows with features squared and dwarfs preprocessing on CPU")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--read-in-loop", action="store_true", help="read raw Parquet rows inside the timed loop")
    ap.add_argument("--dense-arch", type=int, nargs="*", default=[256])
    ap.add_argument("--over-arch", type=int, nargs="*", default=[256, 128])
    ap.add_argument("--sharding", default="table_wise")
    ap.add_argument("--stage", default="mlp_bwd", help="without --schedule: the stage every kernel starts in (the "
                    "pipeline's default: the longest stage; autograd runs in C++ and needs the GIL least)")
    ap.add_argument("--schedule", type=Path, default=None,
                    help="a co-run schedule JSON (recforge.rap.planning.schedule)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_rap.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_rap_") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        print(f"trainer threads {args.threads}, co-run threads {args.corun_threads}, batch {args.batch}, "
              f"{args.steps} steps x {args.rounds} rounds; cpus {os.cpu_count()}, load average {os.getloadavg()}",
              flush=True)
        results = {}
        for name in [p.strip() for p in args.plans.split(",") if p.strip()]:
            results[name] = bench_plan(name, args, Path(tmp))
            print(f"{name} done", flush=True)
        dist.destroy_process_group()
    print_table(results)
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "settings": ({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
                     | {"torch": torch.__version__}),
        "plans": results,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
