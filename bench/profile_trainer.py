"""Profile our TorchRec DLRM trainer on this machine: samples/s and worker memory per resource configuration.

Each point is one real `recforge.elastic.run_training_job` (torchrun, job master, the real worker) on
small generated Criteo-like data, sized to train for about `--target-s` seconds. Configurations are
visited in a fresh shuffled order in each repetition so that drifting background load (the machine is
shared) spreads over all of them; the fit uses the median over repetitions.

Memory: a sampler thread reads the RSS of every worker process (matched by the job's spec path, rank
from its environment) twice a second; the peak and the RSS-vs-time slope go into the point.

    python bench/profile_trainer.py --out platform/recforge/elastic/optimizer/models/profiles/dlrm_criteo_2core.json

The cold-start MEMORY prior is profiled separately, as the daily pipeline trains (the schema plan's tables at two
sizes, so that the fit can tell the embedding factor from the base; flash checkpoints every 100 steps):

    python bench/profile_trainer.py --memory \
        --out platform/recforge/elastic/optimizer/models/profiles/dlrm_criteo_2core_memory.json

The output (JSON) is rewritten atomically after every point, so an interrupted run keeps what it measured;
`--resume` skips the (config, repetition) pairs already in the file. It holds measurements only: a point that
failed is reported on the console (with its error) and left out, so `--resume` measures it again.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_model  # noqa: E402  # bench/_results.py

ROWS_PER_SHARD = 10_000


class RssSampler(threading.Thread):
    """Polls the RSS of the processes whose command line holds `marker` (the job's spec path)."""

    def __init__(self, marker: str, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.marker, self.interval_s = marker, interval_s
        self.samples: dict[int, list[tuple[float, int]]] = {}  # rank -> [(t, rss)]
        self._ranks: dict[int, int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._halt.is_set():
            for p in psutil.process_iter(["pid", "cmdline"]):
                try:
                    cmd = p.info["cmdline"] or []
                    if "recforge.worker" not in cmd or not any(self.marker in c for c in cmd):
                        continue
                    rank = self._ranks.get(p.pid)
                    if rank is None:
                        rank = int(p.environ().get("RANK", "-1"))
                        self._ranks[p.pid] = rank
                    self.samples.setdefault(rank, []).append((time.monotonic() - t0, p.memory_info().rss))
                except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
                    continue
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for rank, s in sorted(self.samples.items()):
            rss = [r for _, r in s]
            # growth: slope over the second half of the run (after model build and sharding)
            half = s[len(s) // 2:]
            slope = 0.0
            if len(half) >= 3:
                ts = [t for t, _ in half]
                rs = [r for _, r in half]
                mt, mr = statistics.fmean(ts), statistics.fmean(rs)
                den = sum((t - mt) ** 2 for t in ts)
                slope = sum((t - mt) * (r - mr) for t, r in zip(ts, rs, strict=True)) / den if den > 0 else 0.0
            out[str(rank)] = {"peak_rss_bytes": max(rss), "rss_slope_bytes_per_s": slope, "samples": len(s)}
        return out


def prepare_data(root: Path, rows: int, seed: int):
    from recforge.config import dataset_preset
    from recforge.data.generator import generate_days
    from recforge.data.ingest import ingest

    ds = dataset_preset("criteo_kaggle")
    generate_days(ds, root / "raw", days=1, rows_per_day=rows, seed=seed)
    manifest = ingest([root / "raw" / "day_0.tsv"], ds, root / "train", rows_per_shard=ROWS_PER_SHARD,
                      max_bad_fraction=0.01)
    return ds, manifest


def run_point(root: Path, ds, manifest, plan_path: Path, tables, cfg: dict, rows: int, tag: str,
              checkpoint_every: int = 0) -> dict:
    from recforge.config import ModelConfig, ResourceConfig, TrainConfig
    from recforge.elastic.backends.local import LocalBackend
    from recforge.elastic.job import run_training_job
    from recforge.elastic.policy import StaticPolicy

    w, t, b = cfg["workers"], cfg["threads_per_worker"], cfg["batch_size"]
    job_dir = root / "jobs" / tag
    shutil.rmtree(job_dir, ignore_errors=True)
    model = ModelConfig()
    train = TrainConfig(epochs=1, batch_size=b, batches_per_task=4, log_every=1000)
    spec = {
        "manifest_dir": str(root / "train"), "plan_path": str(plan_path),
        "dataset": ds.model_dump(mode="json"), "model": model.model_dump(mode="json"),
        "train": train.model_dump(mode="json"), "checkpoint_dir": str(job_dir / "ckpt"),
        "output_dir": str(job_dir / "out"), "seed": 0,
    }
    if checkpoint_every:  # as the pipeline trains: flash step checkpoints (shared memory, persisted by the agent)
        spec["recovery"] = {"checkpoint_every_steps": checkpoint_every, "flash": True,
                            "checkpoint_root": str(job_dir / "steps")}
    full = [s.rows for s in manifest.shards]
    shard_rows, left = [], rows
    for n in full:  # a prefix of the shards: rows beyond the budget get no tasks
        take = min(n, max(left, 0))
        shard_rows.append(take)
        left -= take
    resources = ResourceConfig(policy="static", workers=w, threads_per_worker=t, max_restarts=0)
    sampler = RssSampler(str(job_dir / "master"))
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    sampler.start()
    try:
        result = run_training_job(
            spec, shard_rows, resources=resources, state_dir=job_dir / "master",
            policy=StaticPolicy(resources, cpu_count=10_000), backend=LocalBackend(max_restarts=0, log_dir=job_dir),
            resume=False, timeout_s=600,
        )
    finally:
        sampler.stop()
    wall = time.perf_counter() - t0
    worker = json.loads((job_dir / "out" / "result.json").read_text())
    from recforge.elastic.optimizer.models.memory_model import embedding_bytes_per_rank

    emb = embedding_bytes_per_rank(worker["sharding_plan"], tables, model.embedding_dim, w)
    point = {
        **cfg,
        "rows": sum(shard_rows),
        "samples": result.samples,
        "samples_per_s": worker["samples_per_s"],
        "steps": worker["steps"],
        "train_wall_s": worker["train_wall_s"],
        "job_wall_s": wall,
        "loadavg_before": load_before[0],
        "loadavg_after": os.getloadavg()[0],
        "embedding_bytes_per_rank": emb,
        "memory": sampler.summary(),
        "sharding_types": sorted({p["sharding_type"] for p in worker["sharding_plan"].values()}),
    }
    shutil.rmtree(job_dir, ignore_errors=True)
    return point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="default 1 2 3 (with --memory 1 2)")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="default 1 2 (with --memory 1)")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="default 256 512 1024 (with --memory 512)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--target-s", type=float, default=20.0, help="training seconds per point (approximate)")
    ap.add_argument("--initial-rate", type=float, default=4000.0, help="samples/s guess before any measurement")
    ap.add_argument("--data-rows", type=int, default=400_000)
    ap.add_argument("--table-cap", type=int, nargs="+", default=None,
                    help="table caps profiled (default 20000; with --memory 20000 100000)")
    ap.add_argument("--memory", action="store_true",
                    help="the memory prior's profile: the schema plan (hash_headroom as the pipeline's default), "
                         "flash checkpoints every 100 steps, 1 and 2 workers x 1 thread, batch 512, table caps "
                         "20000 and 100000 unless given")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--fit-only", action="store_true", help="no measuring: fit the model on --out and report")
    args = ap.parse_args(argv)
    if args.fit_only:
        return report_fit(args.out)

    from recforge.config import HASH_HEADROOM
    from recforge.preprocess.planning.plan import criteo_plan, schema_plan

    caps = args.table_cap or ([20_000, 100_000] if args.memory else [20_000])
    workers = args.workers or ([1, 2] if args.memory else [1, 2, 3])
    threads = args.threads or ([1] if args.memory else [1, 2])
    batches = args.batch or ([512] if args.memory else [256, 512, 1024])
    checkpoint_every = 100 if args.memory else 0
    configs = [{"workers": w, "threads_per_worker": t, "batch_size": b, "table_cap": c}
               for w, t, b, c in itertools.product(workers, threads, batches, caps)]
    doc = {"points": []}
    if args.resume and args.out.exists():
        doc = json.loads(args.out.read_text())
    doc["conditions"] = {
        "machine": {"cpu_model": cpu_model(), "logical_cpus": os.cpu_count(),
                    "memory_bytes": psutil.virtual_memory().total,
                    "python": platform.python_version(), "torch": __import__("torch").__version__,
                    "torchrec": __import__("torchrec").__version__},
        "dataset": "criteo_kaggle preset, generated (recforge.data.generate_days), ingested in shards of "
                   f"{ROWS_PER_SHARD} rows",
        "table_cap": caps if len(caps) > 1 else caps[0],
        "plan": f"schema plan, hash_headroom {HASH_HEADROOM}" if args.memory else "criteo (RAP plan 0)",
        "checkpoints": "flash every 100 steps" if args.memory else "final only",
        "model": "ModelConfig() defaults (dlrm, embedding_dim 16)",
        "train": "TrainConfig defaults except batch_size, batches_per_task=4, epochs=1; "
                 "sharding auto, fused embeddings",
        "target_train_s": args.target_s, "repeats": args.repeats, "order": "shuffled per repetition (seed given)",
        "samples_per_s": "the worker's result.json: samples / train wall time "
                         "(excludes startup, model build, sharding)",
        "seed": args.seed,
    }
    def key_of(p: dict) -> tuple:
        return p["workers"], p["threads_per_worker"], p["batch_size"], p.get("table_cap", caps[0])

    done = {(*key_of(p), p["rep"]) for p in doc["points"]}
    rates: dict[tuple, float] = {}
    for p in doc["points"]:
        rates[key_of(p)] = p["samples_per_s"]

    root = Path(tempfile.mkdtemp(prefix="recforge_profile_"))
    try:
        t0 = time.perf_counter()
        ds, manifest = prepare_data(root, args.data_rows, args.seed)
        plans = {}
        for cap in caps:
            plans[cap] = schema_plan(ds, cap, HASH_HEADROOM) if args.memory else criteo_plan(ds, cap)
            plans[cap].save(root / f"plan_{cap}.json")
        print(f"data ready in {time.perf_counter() - t0:.1f}s: {manifest.total_rows} rows", flush=True)
        rng = random.Random(args.seed)
        for rep in range(args.repeats):
            order = list(configs)
            rng.shuffle(order)
            for cfg in order:
                key = key_of(cfg)
                if (*key, rep) in done:
                    continue
                rate = rates.get(key) or (statistics.median(rates.values()) if rates else args.initial_rate)
                # --memory: every row, so each job passes several step checkpoints (their copies count)
                rows = manifest.total_rows if args.memory else int(
                    min(manifest.total_rows, max(cfg["batch_size"] * cfg["workers"] * 20, rate * args.target_s)))
                tag = f"w{key[0]}t{key[1]}b{key[2]}c{key[3]}r{rep}"
                cap = cfg["table_cap"]
                try:
                    point = run_point(root, ds, manifest, root / f"plan_{cap}.json", plans[cap].tables(), cfg, rows,
                                      tag, checkpoint_every)
                except Exception as e:  # keep profiling the others; the failure goes to the console, not the file
                    print(f"{tag}: failed: {e!r}", flush=True)
                    continue
                point["rep"] = rep
                doc["points"].append(point)
                rates[key] = point["samples_per_s"]
                tmp = args.out.with_suffix(".tmp")
                args.out.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(doc, indent=1))
                os.replace(tmp, args.out)
                print(f"{tag}: {point['samples_per_s']:,.0f} samples/s, train {point['train_wall_s']:.1f}s, "
                      f"job {point['job_wall_s']:.1f}s, load {point['loadavg_before']:.1f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def report_fit(path: Path) -> int:
    """Term selection, fit and held-out MAPE on a profile; writes <profile>.fit.json and a plot in bench/results."""
    from recforge.elastic.optimizer.models.memory_model import (
        DEFAULT_MEMORY_MODEL,
        fit_or_prior,
        profile_memory_samples,
    )
    from recforge.elastic.optimizer.models.throughput_model import fit_profile, load_profile

    samples, cond = load_profile(path)
    res = fit_profile(samples)
    out = {"profile": path.name, "configurations": len(samples), **res.summary()}
    one = [s for s in samples if s.allocation.cpu_per_worker == 1]
    if len({(s.allocation.workers, s.allocation.batch_size) for s in one}) >= 4:
        r1 = fit_profile(one)
        out["threads_1_only"] = {"terms": list(r1.model.terms), "cv_mape": r1.selection.cv_mape,
                                 "held_out_mape": r1.held_out_mape, "n_train": len(r1.train)}
    mem = profile_memory_samples(path)  # one run per point: the fit reports its leave-one-run-out error
    if mem:
        out["memory_model"] = fit_or_prior(mem, DEFAULT_MEMORY_MODEL).to_dict()
    print(json.dumps(out, indent=1))
    (path.with_suffix(".fit.json")).write_text(json.dumps(out, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        from recforge.elastic.optimizer.models.resource_store import predicted_vs_measured_figure

        fig = predicted_vs_measured_figure(res.model, res.train, res.held_out, f"{path.stem}: {res.model.describe()}")
        target = Path(__file__).resolve().parent / "results" / f"{path.stem}_predicted_vs_measured.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, dpi=120)
        print(f"wrote {target}")
    except Exception as e:  # the plot is a convenience
        print(f"no plot: {e!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
