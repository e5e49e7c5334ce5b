"""RAP's mapping on 2 gloo ranks, side by side in one run (`recforge bench rap_mapping`).

  unmapped_inline  every rank preprocesses every feature of its local batch before its step; torchrec's input
                   all-to-all moves the ids to their tables' owners (RAP's "w/o mapping", without co-running)
  mapped_inline    each rank preprocesses the tables it holds over the global batch and its dense / data-parallel
                   features over its local batch; no input all-to-all (recforge.rap.mapping.mapped_input)
  unmapped_corun   as unmapped_inline, the kernels co-run in step i's stages (one job)
  mapped_corun     RAP: as mapped_inline, co-run (two jobs: global, local)

Both ranks train the same rows in every variant (global batch k of a task: rank r takes rows r*B..(r+1)*B), from one
table_wise placement (torchrec's planner), so the variants differ only in where the ids are preprocessed and
whether the input all-to-all runs. Raw rows are read before timing and served from memory. Fixed threads: the
trainer --threads per rank, the co-run thread --corun-threads. Rounds interleave the variants; medians of samples/s
(global) and ratios of medians. Before timing, each variant's per-step losses over one epoch from the same weights
are compared (they must be equal). Also per rank: the median input all-to-all time of one batch, and the median
fused preprocessing time of one step's work unmapped (all features, B rows) vs mapped (held tables over W*B rows
+ the rest over B).

    python bench/bench_rap_mapping.py                          # plan0, batch 2048, 8 steps x 5 rounds
    python bench/bench_rap_mapping.py --plan plan2 --rounds 7

Writes bench/results/bench_rap_mapping.json (temp + rename) and prints a table. On 2 cores the co-run variants
run 4 threads (2 ranks x (trainer + co-run)): they measure contention as much as co-running.
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
from bench_rap import FixedTasks, RowsInMemory, make_data
from recforge.config import ModelConfig, TrainConfig
from recforge.data.shards import read_rows
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.presets import load_plan, preset_dataset
from recforge.rap.mapping.mapped_batches import MappedCorunBatches, MappedTaskBatches
from recforge.rap.mapping.mapped_input import MappedInput
from recforge.rap.mapping.milp import from_torchrec, split_rank_plan
from recforge.rap.planning.schedule import whole_kernel_schedule
from recforge.rap.runtime.corun_batches import CorunBatch, CorunReadAhead
from recforge.rap.runtime.session import CorunSession
from recforge.train.distributed import free_port
from recforge.train.loop.batches import Batch, slice_raw
from recforge.train.loop.step_loop import LoopState, train_epoch
from recforge.train.model import build_dlrm
from recforge.train.sharding import shard_model

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("unmapped_inline", "mapped_inline", "unmapped_corun", "mapped_corun")
WORLD = 2


class Unmapped(RowsInMemory, MappedTaskBatches):
    """The same rows per rank and step as the mapped source; every feature of the local rows, plain KJT."""

    def prepare_mapped(self, raw):
        dense, kjt = self.local_executor(raw.local)
        return Batch(dense=dense, sparse=kjt, labels=raw.local.label, weights=raw.weights, real=raw.real)


class UnmappedCorun(RowsInMemory, CorunReadAhead, MappedTaskBatches):
    def __init__(self, client, manifest, ds, runtime, batch, rank, step_boundary, step_done):
        MappedTaskBatches.__init__(self, client, manifest, ds, runtime.executor, None, batch, torch.device("cpu"),
                                   rank, WORLD)
        self._init_corun(runtime, step_boundary, step_done)

    def prepare_mapped(self, raw):
        return CorunBatch(dense=None, sparse=None, labels=raw.local.label, weights=raw.weights, real=raw.real,
                          pending=self.runtime.launch(raw.local))


class Mapped(RowsInMemory, MappedTaskBatches):
    pass


class MappedCorun(RowsInMemory, MappedCorunBatches):
    pass


def _jobs(ctx, rank: int, stage: str):
    out = []
    for job, sub in (("global", ctx["global_plan"]), ("local", ctx["local_plan"])):
        if sub is None:
            continue
        ex = FusedExecutor(sub, ctx["ds"], method="greedy")
        rows = ctx["batch"] * (WORLD if job == "global" else 1)
        out.append((ex, whole_kernel_schedule(ex.compiled, stage, meta={"job": job, "rows": rows})))
    return out


def run_epoch(variant: str, sharded, ctx: dict[str, Any], rank: int, losses: list[float] | None = None) -> float:
    cpu, b, ds = torch.device("cpu"), ctx["batch"], ctx["ds"]
    client = FixedTasks(list(range(len(ctx["shard_rows"]))), ctx["shard_rows"]) if rank == 0 else FixedTasks([], [])
    RowsInMemory.rows = ctx["rows_in_memory"]
    session = None
    if variant == "unmapped_inline":
        source = Unmapped(client, ctx["manifest"], ds, ctx["full"], None, b, cpu, rank, WORLD)
    elif variant == "mapped_inline":
        source = Mapped(client, ctx["manifest"], ds, ctx["local"], ctx["global"], b, cpu, rank, WORLD)
    elif variant == "unmapped_corun":
        session = CorunSession(ctx["plan"], ds, whole_kernel_schedule(ctx["corun_full"].compiled, ctx["stage"]),
                               sharded.model, cpu, threads=ctx["corun_threads"], executor=ctx["corun_full"])
        source = UnmappedCorun(client, ctx["manifest"], ds, session.runtime, b, rank, session.step_boundary,
                               session.step_done)
    else:
        session = CorunSession(ctx["plan"], ds, None, sharded.model, cpu, threads=ctx["corun_threads"],
                               jobs=_jobs(ctx, rank, ctx["stage"]), mapped=ctx["mapped"][id(sharded)])
        source = MappedCorun(client, ctx["manifest"], ds, session.runtime, b, cpu, rank, WORLD,
                             step_boundary=session.step_boundary, step_done=session.step_done)
    sink = (lambda m, step: losses.append(m["train_loss"])) if losses is not None and rank == 0 else None
    stats = train_epoch(sharded, source, None, LoopState(), epoch=0, world_size=WORLD, rank=rank,
                        log_every=1 if losses is not None else 10**9, sink=sink)
    if session is not None:
        session.close()
    return stats.wall_s


def median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def worker(rank: int, port: int, args, root: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    ds = preset_dataset(args.plan)
    plan = load_plan(args.plan, ds, args.table_cap)
    rows = args.batch * WORLD * args.steps
    manifest, shard_rows = (make_data(ds, rows, args.batch * WORLD * args.batches_per_task, Path(root), args.seed)
                            if rank == 0 else (None, None))
    box = [manifest, shard_rows]
    dist.broadcast_object_list(box, src=0)
    manifest, shard_rows = box
    torch.manual_seed(args.seed)
    model_cfg = ModelConfig(arch=args.arch, embedding_dim=args.dim, dense_arch=[*args.dense_arch, args.dim],
                            over_arch=[*args.over_arch, 1])
    init = build_dlrm(model_cfg, plan.tables(), len(plan.dense_features()))
    state = {k: v.clone() for k, v in init.state_dict().items()}
    train = TrainConfig(batch_size=args.batch, sharding="table_wise")
    placements = from_torchrec(shard_model(init, train, world_size=WORLD, device=torch.device("cpu")).plan_summary())
    local_plan, global_plan = split_rank_plan(plan, placements, rank)
    ctx = {"plan": plan, "ds": ds, "manifest": manifest, "shard_rows": shard_rows, "batch": args.batch,
           "stage": args.stage, "corun_threads": args.corun_threads, "mapped": {},
           "full": FusedExecutor(plan, ds, method="greedy"), "corun_full": FusedExecutor(plan, ds, method="greedy"),
           "local": FusedExecutor(local_plan, ds, method="greedy"), "local_plan": local_plan,
           "global": FusedExecutor(global_plan, ds, method="greedy") if global_plan else None,
           "global_plan": global_plan,
           "rows_in_memory": {i: RawBatch.from_arrow(read_rows(manifest, i, 0, n), ds)
                              for i, n in enumerate(shard_rows)}}

    def fresh(variant: str):
        m = build_dlrm(model_cfg, plan.tables(), len(plan.dense_features()))
        m.load_state_dict(state)
        sharded = shard_model(m, train, world_size=WORLD, device=torch.device("cpu"), placements=placements)
        if variant.startswith("mapped"):
            ctx["mapped"][id(sharded)] = MappedInput.install(sharded.model, rank, WORLD)
        return sharded

    curves = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        run_epoch(v, fresh(v), ctx, rank, curves[v])
    models = {v: fresh(v) for v in VARIANTS}  # one model per variant, trained on in turn
    for v in VARIANTS:
        run_epoch(v, models[v], ctx, rank)  # warm-up
    walls = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            walls[v].append(run_epoch(v, models[v], ctx, rank))
    # per-rank costs of one step's input: the all-to-all of the ids, the preprocessing each way
    raw = RawBatch.concat([slice_raw(ctx["rows_in_memory"][0], k * args.batch, (k + 1) * args.batch)
                           for k in range(WORLD)])
    local_raw = slice_raw(raw, rank * args.batch, (rank + 1) * args.batch)
    _, kjt = ctx["full"](local_raw)
    sebc = ctx["mapped"][id(models["mapped_inline"])].sebc

    def a2a():
        sebc.input_dist(sebc.create_context(), kjt).wait().wait()

    report = {
        "rank": rank, "global_features": len(global_plan.features) if global_plan else 0,
        "input_all_to_all_ms": median_ms(a2a, args.reps),
        "preprocess_unmapped_ms": median_ms(lambda: ctx["full"](local_raw), args.reps),
        "preprocess_mapped_ms": median_ms(lambda: (ctx["local"](local_raw),
                                                   ctx["global"](raw) if ctx["global"] else None), args.reps),
        "walls": walls, "curves": curves,
    }
    torch.save(report, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def summarize(reports: list[dict[str, Any]], args) -> dict[str, Any]:
    rows = args.batch * WORLD * args.steps
    walls = {v: [max(r["walls"][v][i] for r in reports) for i in range(args.rounds)] for v in VARIANTS}
    sps = {v: statistics.median(rows / w for w in walls[v]) for v in VARIANTS}
    curves = reports[0]["curves"]
    return {
        "samples_per_s": {v: {"median": sps[v], "rounds": [rows / w for w in walls[v]]} for v in VARIANTS},
        "ratios": {"mapped_vs_unmapped_inline": sps["mapped_inline"] / sps["unmapped_inline"],
                   "mapped_vs_unmapped_corun": sps["mapped_corun"] / sps["unmapped_corun"],
                   "mapped_corun_vs_unmapped_inline": sps["mapped_corun"] / sps["unmapped_inline"]},
        "loss_curves_equal": all(curves[v] == curves["unmapped_inline"] for v in VARIANTS),
        # a length mismatch shows in loss_curves_equal; the diff is over the common steps
        "max_loss_diff": max(abs(a - b) for v in VARIANTS
                             for a, b in zip(curves[v], curves["unmapped_inline"], strict=False)),
        "loss_steps": len(curves["unmapped_inline"]),
        "per_rank": [{k: r[k] for k in ("rank", "global_features", "input_all_to_all_ms", "preprocess_unmapped_ms",
                                        "preprocess_mapped_ms")} for r in reports],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default="plan0")
    ap.add_argument("--batch", type=int, default=2048, help="per rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batches-per-task", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9, help="repetitions of the per-rank cost measurements")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--corun-threads", type=int, default=1)
    ap.add_argument("--table-cap", type=int, default=20_000)
    ap.add_argument("--arch", default="dlrm_dcn", choices=["dlrm", "dlrm_dcn"])
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--dense-arch", type=int, nargs="*", default=[256])
    ap.add_argument("--over-arch", type=int, nargs="*", default=[256, 128])
    ap.add_argument("--stage", default="mlp_bwd")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_rap_mapping.json")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    port = free_port()
    print(f"2 ranks x ({args.threads} trainer + {args.corun_threads} co-run threads), batch {args.batch}/rank, "
          f"{args.steps} steps x {args.rounds} rounds; cpus {os.cpu_count()}, load {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_rap_mapping_") as tmp:
        mp.spawn(worker, args=(port, args, tmp, tmp), nprocs=WORLD)
        reports = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    result = summarize(reports, args)
    s, q = result["samples_per_s"], result["ratios"]
    print("  ".join(f"{v} {s[v]['median']:,.0f}" for v in VARIANTS), "samples/s (medians)")
    print(f"mapped/unmapped: inline {q['mapped_vs_unmapped_inline']:.3f}, corun {q['mapped_vs_unmapped_corun']:.3f}; "
          f"losses {'equal' if result['loss_curves_equal'] else 'DIFFER'} (max diff {result['max_loss_diff']:.2e})")
    for r in result["per_rank"]:
        print(f"rank {r['rank']}: {r['global_features']} tables held; "
              f"input all-to-all {r['input_all_to_all_ms']:.2f} ms; "
              f"preprocessing unmapped {r['preprocess_unmapped_ms']:.2f} ms "
              f"vs mapped {r['preprocess_mapped_ms']:.2f} ms")
    write_report(args.out, {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "settings": ({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
                     | {"torch": torch.__version__}),
        "result": result,
    })


if __name__ == "__main__":
    main()
