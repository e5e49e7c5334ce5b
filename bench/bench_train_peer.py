"""recforge's train task against TorchRec's reference training loop, side by side (`recforge bench train_peer`).

  recforge   the real training job (its default step loop, over PrefetchBatches): run_training_job (torchrun, the job
             master leasing data-shard tasks, the lineage ledger, events, flash step checkpoints every
             CheckpointConfig().every_steps steps), the default (schema) plan run by the fused executor inline, over
             the ingested Parquet shards
  reference  bench/train_peer/reference.py: our re-implementation of torchrec_dlrm's loop (DMP over the same DLRM and
             planner constraints, the embedding optimizer in backward, TrainPipelineSparseDist) over the same rows,
             preprocessed before timing with its standard transform (log(x + 3), id mod table size)

Both: `--workers` ranks (gloo), `--threads` intra-op thread(s) each (OMP_NUM_THREADS too), the same batch per rank,
model (ModelConfig defaults), optimizers and learning rates (TrainConfig defaults), seed. Rounds are interleaved
(recforge, reference, recforge, ...); medians per side and the ratio of medians. Each round also writes both sides'
step time per phase (wall-clock timers; on CPU every op is synchronous): recforge's step loop (data = waiting for the
step's batches and global counts, forward, backward, optimizer, coordination = done reports, heartbeats, window
metrics, checkpoints) plus the seconds its prefetch thread spent off the step's path (lease + read + preprocess +
all_reduce, done reports); the reference's over `--profile-steps` unpipelined steps of a second model. TorchRec's
all-to-alls are inside forward / backward on both sides, DDP's all_reduce inside backward. Held-out AUC: every row
of the following generated day, each side with its own transform (recforge: its final checkpoint, unsharded,
recforge.train.metrics.evaluate; the reference: its sharded model).

    python bench/bench_train_peer.py                     # 2.4M rows, 2 ranks x 1 thread, batch 512, 3 rounds
    python bench/bench_train_peer.py --rows 200000 --rounds 1
    python bench/bench_train_peer.py --rows 200000 --sides recforge,recforge_sync   # also without prefetching
    python bench/bench_train_peer.py --rows 200000 --sides recforge,recforge_pipelined  # TorchRec's pipeline on

Writes bench/results/bench_train_peer.json (temp + rename) and prints a table. A configuration the machine cannot
hold (more ranks x threads than cores, data beyond the memory available) is refused before anything runs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from _results import cpu_model, write_report  # bench/_results.py (bench/ is the script's directory)

RESULTS = Path(__file__).resolve().parent / "results"
ROWS_PER_SHARD = 50_000
SIDES = ("recforge", "reference", "recforge_sync", "recforge_pipelined", "recforge_normal", "recforge_system_alloc",
         "reference_kept_alloc", "recforge_torchrec_model", "recforge_fbgemm_update",
         "recforge_allreduce")
# env of recforge's sides (JOB_ENV's variables are cleared first): recforge_pipelined turns on TorchRec's input-dist
# pipeline in the step loop (recforge.train.loop.pipelined; off by default); recforge_normal runs the prefetch thread
# at normal priority (the default is SCHED_IDLE: it takes a core only when nothing else of the rank's wants it);
# recforge_system_alloc launches the ranks with every allocator as it is (the default keeps freed pages:
# recforge.elastic.allocator_env). reference_kept_alloc: the reference's ranks with recforge's allocator settings.
SIDE_ENV = {"recforge_pipelined": {"RECFORGE_TRAIN_PIPELINE": "1"},
            "recforge_normal": {"RECFORGE_PREFETCH_SCHED": "normal"},
            "recforge_system_alloc": {"RECFORGE_ALLOCATOR": "system"}}
# TrainConfig fields of recforge's sides: recforge_torchrec_model trains torchrec's DLRM modules, FBGEMM's embedding
# backward and DDP's allreduce as they ship (the reference's model, kernels and collectives) in place of recforge's
# fused interaction (train.fused_interaction), row-wise Adagrad kernel (train.rowwise_adagrad_kernel) and dense
# gradient exchange (train.dense_grad_exchange); recforge_fbgemm_update and recforge_allreduce turn off one each
SIDE_TRAIN: dict[str, dict[str, Any]] = {
    "recforge_torchrec_model": {"fused_interaction": False, "rowwise_adagrad_kernel": False,
                                "dense_grad_exchange": False},
    "recforge_fbgemm_update": {"rowwise_adagrad_kernel": False},
    "recforge_allreduce": {"dense_grad_exchange": False}}
JOB_ENV = ("RECFORGE_STEP_PHASES", "RECFORGE_TRAIN_PREFETCH", "RECFORGE_TRAIN_PIPELINE", "RECFORGE_PREFETCH_SCHED",
           "RECFORGE_ALLOCATOR")
# samples/s ratios reported where both sides ran: (key, numerator side, denominator side)
RATIOS = (("ratio_prefetch_vs_sync", "recforge", "recforge_sync"),
          ("ratio_pipelined_vs_not", "recforge_pipelined", "recforge"),
          ("ratio_idle_prefetch_vs_normal", "recforge", "recforge_normal"),
          ("ratio_kept_vs_system_alloc", "recforge", "recforge_system_alloc"),
          ("ratio_vs_reference_kept_alloc", "recforge", "reference_kept_alloc"),
          ("ratio_fused_vs_torchrec_model", "recforge", "recforge_torchrec_model"),
          ("ratio_kernel_vs_fbgemm_update", "recforge", "recforge_fbgemm_update"),
          ("ratio_exchange_vs_allreduce", "recforge", "recforge_allreduce"))
REFERENCE_BYTES_PER_ROW = 1200  # measured order: raw + preprocessed + batched copies, per process holding the rows


class ConfigRefused(ValueError):
    """The machine cannot hold the asked-for configuration (the message names the limit)."""


def check_machine(rows: int, eval_rows: int, workers: int, threads: int, *, cpus: int | None = None,
                  available_bytes: int | None = None) -> dict[str, int]:
    """Refuse before starting: ranks x threads beyond the cores (the comparison assumes each rank owns its cores),
    or the reference's in-memory rows (every rank and the parent hold them) beyond 80% of the available memory."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    available = available_bytes if available_bytes is not None else psutil.virtual_memory().available
    if rows < 1 or eval_rows < 1 or workers < 1 or threads < 1:
        raise ConfigRefused(f"rows ({rows}), eval rows ({eval_rows}), workers ({workers}) and threads ({threads}) "
                            "must be >= 1")
    if workers * threads > cpus:
        raise ConfigRefused(f"{workers} ranks x {threads} thread(s) = {workers * threads} threads > os.cpu_count() = "
                            f"{cpus}: the ranks would share cores and the comparison would measure contention")
    need = (rows + eval_rows) * REFERENCE_BYTES_PER_ROW * (workers + 1)
    if need > 0.8 * available:
        raise ConfigRefused(f"the reference holds {rows + eval_rows} rows in memory in {workers + 1} processes: about "
                            f"{need / 2**30:.1f} GiB > 80% of psutil.virtual_memory().available = "
                            f"{available / 2**30:.1f} GiB; use fewer --rows / --eval-rows")
    return {"cpus": cpus, "available_bytes": available, "reference_bytes_estimate": need}



def prepare_data(root: Path, rows: int, eval_rows: int, seed: int, table_cap: int):
    """Day 0 (`rows`, training) and day 1 (`eval_rows`, held out) generated and ingested; the default plan saved."""
    from recforge.config import criteo_kaggle_dataset
    from recforge.data.generator import default_cardinality_scale, generate_days
    from recforge.data.ingest import ingest
    from recforge.preprocess.planning.plan import schema_plan

    ds = criteo_kaggle_dataset()
    scale = default_cardinality_scale(ds, rows)  # one hidden model for both days
    generate_days(ds, root / "raw", days=1, rows_per_day=rows, seed=seed, cardinality_scale=scale)
    held_report = generate_days(ds, root / "raw_eval", days=1, rows_per_day=eval_rows, seed=seed, first_day=1,
                                cardinality_scale=scale)
    train = ingest([root / "raw" / "day_0.tsv"], ds, root / "train", rows_per_shard=ROWS_PER_SHARD,
                   max_bad_fraction=0.01)
    held = ingest([root / "raw_eval" / "day_0.tsv"], ds, root / "eval", rows_per_shard=ROWS_PER_SHARD,
                  max_bad_fraction=0.01)
    shutil.rmtree(root / "raw")  # the shards hold the rows now
    shutil.rmtree(root / "raw_eval")
    plan = schema_plan(ds, table_cap)
    plan.save(root / "plan.json")
    return ds, plan, train, held, held_report


def reference_rows(root: Path, ds, plan, train_manifest, eval_manifest) -> Path:
    """Every row of both days, read from the shards and transformed the reference's way, saved for its ranks."""
    import torch

    from recforge.data.shards import read_rows
    from recforge.preprocess.batch import RawBatch
    from train_peer.reference import save_rows, transform

    tables = plan.tables()
    sizes = [n for _, n in tables]
    keys = [name for name, _ in tables]
    if keys != list(ds.sparse_names):
        raise ValueError(f"the plan's tables {keys} are not the dataset's sparse columns {ds.sparse_names} in order")

    def rows_of(manifest, mdir: Path):
        parts = [transform(RawBatch.from_arrow(read_rows(mdir, i, 0, s.rows), ds), sizes)
                 for i, s in enumerate(manifest.shards)]
        return type(parts[0])(dense=torch.cat([p.dense for p in parts]), ids=torch.cat([p.ids for p in parts]),
                              labels=torch.cat([p.labels for p in parts]))

    train_rows = rows_of(train_manifest, root / "train")
    # the reference's dense input is its own transform's: one column per dense count (the default plan may add more)
    return save_rows(root / "reference_rows.pt", train_rows, rows_of(eval_manifest, root / "eval"), keys, tables,
                     int(train_rows.dense.shape[1]))


def run_recforge(root: Path, ds, plan, train_manifest, *, workers: int, threads: int, batch: int, seed: int,
                 tag: str, prefetch: int | None = None, env: dict[str, str] | None = None,
                 train_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """One real training job over every training row; samples/s from the worker's result, AUC on the held-out day.
    `prefetch`: the spec's train.prefetch_steps (0: the synchronous loop), env RECFORGE_TRAIN_PREFETCH cleared for
    the job; None: TrainConfig's default, which that env var overrides where set. The depth reported is the one the
    workers ran (their result). `env`: variables set for the job (SIDE_ENV; RECFORGE_TRAIN_PIPELINE=1: the step loop
    with TorchRec's input-dist pipeline, recforge.train.loop.pipelined); the others of JOB_ENV are cleared.
    `train_fields`: TrainConfig fields of the side (SIDE_TRAIN)."""
    from recforge.config import ModelConfig, ResourceConfig, TrainConfig
    from recforge.config.pipeline import CheckpointConfig
    from recforge.elastic.backends.local import LocalBackend
    from recforge.elastic.job import run_training_job
    from recforge.elastic.policy import StaticPolicy
    from recforge.preprocess.executor import make_executor
    from recforge.train.metrics import evaluate
    from recforge.train.recovery.checkpoint import load_unsharded
    from recforge.train.recovery.spec import RecoverySpec
    from recforge.train.spec import WorkerSpec

    job = root / "jobs" / tag
    shutil.rmtree(job, ignore_errors=True)
    model, ck = ModelConfig(), CheckpointConfig()
    train = TrainConfig(batch_size=batch, **({"prefetch_steps": prefetch} if prefetch is not None else {}),
                        **(train_fields or {}))
    phases_dir = job / "phases"
    spec = WorkerSpec(
        manifest_dir=root / "train", plan_path=root / "plan.json", preprocess_executor="fused", dataset=ds,
        model=model, train=train, checkpoint_dir=job / "checkpoint", output_dir=job / "out", seed=seed,
        threads_per_worker=threads, preprocessing="inline",
        recovery=RecoverySpec(checkpoint_every_steps=ck.every_steps, keep_checkpoints=ck.keep, flash=ck.flash,
                              checkpoint_root=job / "steps", ledger_dir=job / "ledger",
                              events_file=job / "events.jsonl"),
    )
    resources = ResourceConfig(policy="static", workers=workers, threads_per_worker=threads, max_restarts=0)
    saved_env = {k: os.environ.get(k) for k in JOB_ENV}
    for k in JOB_ENV[1:]:
        if k != "RECFORGE_TRAIN_PREFETCH" or prefetch is not None:  # a given depth: the spec decides
            os.environ.pop(k, None)
    os.environ.update({"RECFORGE_STEP_PHASES": str(phases_dir), **(env or {})})
    t0 = time.perf_counter()
    try:
        result = run_training_job(spec, [s.rows for s in train_manifest.shards], resources=resources,
                                  state_dir=job / "master", policy=StaticPolicy(resources, cpu_count=10_000),
                                  backend=LocalBackend(max_restarts=0, log_dir=job), resume=False, timeout_s=3600)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    job_wall = time.perf_counter() - t0
    worker = json.loads((job / "out" / "result.json").read_text())
    trained = load_unsharded(model, plan.tables(), len(plan.dense_features()), job / "checkpoint",
                             plan=plan.model_dump(mode="json")).eval()
    quality = evaluate(trained, make_executor("fused", plan, ds), root / "eval")
    phases = [json.loads(p.read_text()) for p in sorted(phases_dir.glob("phases_rank*.json"))]
    events = [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines() if line.strip()]
    out = {"samples": result.samples, "steps": worker["steps"], "train_wall_s": worker["train_wall_s"],
           "samples_per_s": worker["samples_per_s"], "job_wall_s": job_wall, "heldout_auc": quality["auc"],
           "heldout_logloss": quality["logloss"], "heldout_rows": quality["rows"],
           "sharding_plan": worker["sharding_plan"], "phases": phases,
           "checkpoints": sum(e["event"] == "checkpoint" for e in events),
           "checkpoint_stall_s": sum(float(e.get("stall_s") or 0.0) for e in events if e["event"] == "checkpoint"),
           "prefetch_depth": worker.get("prefetch_steps"), "interaction": worker.get("interaction"),
           "env": env or {}, "train_fields": train_fields or {}}
    shutil.rmtree(job, ignore_errors=True)
    return out


def per_step_ms(phases: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over ranks of each phase's milliseconds per step (keys ending in _s, divided by steps)."""
    out: dict[str, list[float]] = {}
    for p in phases:
        steps = max(float(p.get("steps", 0)), 1.0)
        for k, v in p.items():
            if k.endswith("_s") and k not in ("train_wall_s", "prefetch_thread_s"):
                out.setdefault(k[:-2], []).append(1000.0 * float(v) / steps)
        for k, v in (p.get("prefetch_thread_s") or {}).items():
            out.setdefault(f"thread_{k}", []).append(1000.0 * float(v) / steps)
    return {k: statistics.fmean(v) for k, v in out.items()}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per side over the rounds and the ratios of medians (recforge / reference)."""
    sides = {}
    for side in SIDES:
        rs = [r[side] for r in rounds if side in r]
        if not rs:
            continue
        steps = [per_step_ms(r["phases"]) for r in rs]
        keys = sorted({k for s in steps for k in s})
        sides[side] = {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
            "heldout_auc": statistics.median(r["heldout_auc"] for r in rs),
            "step_ms": {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys},
        }
    out: dict[str, Any] = {"median": sides}
    if "recforge" in sides and "reference" in sides:
        a, b = sides["recforge"], sides["reference"]
        out["ratio_samples_per_s"] = a["samples_per_s"] / b["samples_per_s"]
        out["auc_difference"] = a["heldout_auc"] - b["heldout_auc"]
    for key, num, den in RATIOS:
        if num in sides and den in sides:
            out[key] = sides[num]["samples_per_s"] / sides[den]["samples_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2_400_000, help="training rows (day 0)")
    ap.add_argument("--eval-rows", type=int, default=200_000, help="held-out rows (day 1)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    ap.add_argument("--batch", type=int, default=512, help="rows per rank per step")
    ap.add_argument("--table-cap", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=30, help="reference steps timed per phase (unpipelined)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", default="recforge,reference",
                    help="comma list of recforge, reference, recforge_sync (recforge's loop without prefetching: "
                         "train.prefetch_steps=0), recforge_pipelined (recforge with TorchRec's input-dist pipeline "
                         "in its step loop: RECFORGE_TRAIN_PIPELINE=1), recforge_normal (its prefetch thread at "
                         "normal priority instead of SCHED_IDLE: RECFORGE_PREFETCH_SCHED=normal), "
                         "recforge_system_alloc (its ranks with every allocator as it is: RECFORGE_ALLOCATOR=system), "
                         "reference_kept_alloc (the reference's ranks with recforge's allocator settings), "
                         "recforge_torchrec_model (recforge training torchrec's DLRM modules, FBGEMM's embedding "
                         "backward and DDP's allreduce as they ship: train.fused_interaction, "
                         "train.rowwise_adagrad_kernel and train.dense_grad_exchange false), recforge_fbgemm_update "
                         "(train.rowwise_adagrad_kernel=false), recforge_allreduce (train.dense_grad_exchange=false)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_train_peer.json")
    args = ap.parse_args(argv)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        ap.error(f"--sides: expected some of {', '.join(SIDES)}, got {args.sides!r}")
    try:
        machine = check_machine(args.rows, args.eval_rows, args.workers, args.threads)
    except ConfigRefused as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch  # after OMP_NUM_THREADS

    from recforge.config import ModelConfig, TrainConfig
    from recforge.elastic.allocator_env import KEPT
    from train_peer import reference

    torch.set_num_threads(args.threads)
    from rich.progress import Progress

    root = Path(tempfile.mkdtemp(prefix="recforge_train_peer_"))
    report: dict[str, Any] = {
        "bench": "train_peer", "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"cpu_model": cpu_model(), "logical_cpus": machine["cpus"],
                    "memory_bytes": psutil.virtual_memory().total, "python": platform.python_version(),
                    "torch": torch.__version__, "torchrec": __import__("torchrec").__version__},
        "loadavg_start": os.getloadavg(), "rounds": [],
    }
    try:
        t0 = time.perf_counter()
        ds, plan, train_m, eval_m, held_report = prepare_data(root, args.rows, args.eval_rows, args.seed,
                                                              args.table_cap)
        report["heldout_bayes_auc"] = held_report.bayes_auc[0] if held_report.bayes_auc else None
        data_path = (reference_rows(root, ds, plan, train_m, eval_m)
                     if any(s.startswith("reference") for s in sides) else None)
        report["data_s"] = time.perf_counter() - t0
        print(f"data ready in {report['data_s']:.0f}s: {train_m.total_rows} training rows, {eval_m.total_rows} "
              f"held-out rows; load {os.getloadavg()[0]:.1f}", flush=True)
        with Progress() as bar:
            task = bar.add_task("rounds", total=args.rounds * len(sides))
            for i in range(args.rounds):
                rnd: dict[str, Any] = {"round": i, "loadavg_before": os.getloadavg()}
                for side in sides:
                    if side.startswith("recforge"):
                        rnd[side] = run_recforge(root, ds, plan, train_m, workers=args.workers, threads=args.threads,
                                                 batch=args.batch, seed=args.seed, tag=f"{side}{i}",
                                                 prefetch=0 if side == "recforge_sync" else None,
                                                 env=SIDE_ENV.get(side), train_fields=SIDE_TRAIN.get(side))
                    else:
                        assert data_path is not None
                        ours = next((rnd[s] for s in SIDES if s.startswith("recforge") and s in rnd), None)  # its plan
                        pinned = ({t: v["sharding_type"] for t, v in ours["sharding_plan"].items()}
                                  if ours else None)
                        rnd[side] = reference.run(data_path, model=ModelConfig(),
                                                  train=TrainConfig(batch_size=args.batch), world=args.workers,
                                                  threads=args.threads, seed=args.seed,
                                                  profile_steps=args.profile_steps, pinned=pinned,
                                                  env=KEPT if side == "reference_kept_alloc" else None)
                    bar.console.print(f"round {i} {side}: {rnd[side]['samples_per_s']:,.0f} samples/s, held-out "
                                      f"AUC {rnd[side]['heldout_auc']:.4f}, load {os.getloadavg()[0]:.1f}")
                    bar.advance(task)
                rnd["loadavg_after"] = os.getloadavg()
                report["rounds"].append(rnd)
                report.update(summarize(report["rounds"]))
                write_report(args.out, report)  # after every round: an interrupted run keeps what it measured
        plans = {s: report["rounds"][0][s]["sharding_plan"] for s in sides}
        # the planner's choice; ranks of table_wise tables may differ between the two model wrappers' module paths
        report["same_sharding_plan"] = len({json.dumps(p, sort_keys=True) for p in plans.values()}) == 1
        report["same_sharding_types"] = len({json.dumps({t: (v["sharding_type"], v["compute_kernel"])
                                                         for t, v in p.items()}, sort_keys=True)
                                             for p in plans.values()}) == 1
        report["loadavg_end"] = os.getloadavg()
        write_report(args.out, report)
        print_table(report)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def print_table(report: dict[str, Any]) -> None:
    med = report.get("median", {})
    for side, m in med.items():
        steps = " ".join(f"{k} {v:.2f}" for k, v in m["step_ms"].items())
        print(f"{side:10s} {m['samples_per_s']:>10,.0f} samples/s  AUC {m['heldout_auc']:.4f}  ms/step: {steps}")
    if "ratio_samples_per_s" in report:
        print(f"recforge / reference: {report['ratio_samples_per_s']:.3f}x samples/s, AUC difference "
              f"{report['auc_difference']:+.4f}; same sharding plan: {report.get('same_sharding_plan')}")
    if "ratio_prefetch_vs_sync" in report:
        print(f"recforge prefetching / synchronous loop: {report['ratio_prefetch_vs_sync']:.3f}x samples/s")
    if "ratio_pipelined_vs_not" in report:
        print(f"recforge pipelined / not pipelined: {report['ratio_pipelined_vs_not']:.3f}x samples/s")



if __name__ == "__main__":
    raise SystemExit(main())
