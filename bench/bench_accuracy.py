"""Accuracy of the default configuration (`recforge bench accuracy`): the daily pipeline's held-out AUC against the
generator's Bayes ceiling, as a curve over training rows (issue 17, deliverable 2).

For each row count R: synthetic Criteo-format days (R training rows, the held-out next day of R rows), then the
daily pipeline's own stages in this process (generate, ingest, plan_resources, train, evaluate: the code path of
`recforge run` and of the DAG's tasks) with PipelineConfig's defaults, each row count in its own $RECFORGE_HOME
(fresh MLflow store: no history, no champion). The report gives, per point: AUC, the held-out day's Bayes AUC
(`ceiling`), gap = ceiling - AUC, logloss, normalized entropy, rows, wall time of every stage and train samples/s.
`--set` overrides config fields (a sweep); `--configs` runs several named overrides on the same data (generate and
ingest once per row count).

    python bench/bench_accuracy.py                                 # 100k, 300k, 1M, 2.4M rows: ~30 min on 2 cores
    python bench/bench_accuracy.py --rows 300000 --configs 'base:;lr:train.embedding_lr=0.1'
    python bench/bench_accuracy.py --rows 300000 --configs 'base:;no_indicators:preprocess_plan=schema-missing'
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import psutil  # noqa: E402
import yaml  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_model, write_report  # noqa: E402  # bench/_results.py
from recforge.config import PipelineConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_ROWS = (100_000, 300_000, 1_000_000, 2_400_000)
GOAL_GAP = 0.01  # issue 17: held-out AUC within 0.01 of the Bayes ceiling at 2.4M rows
STAGES = ("generate", "ingest", "plan_resources", "train", "evaluate")  # compile and publish do not change the AUC
DATA_STAGES = ("generate", "ingest")
# what one row costs, measured on the generated Criteo days (the 2.4M-row run's files): raw TSV ~290 B, Parquet
# shards ~110 B; a process of the pipeline (torch, torchrec, pyarrow imported) ~0.8 GiB before its data
RAW_BYTES_PER_ROW, PARQUET_BYTES_PER_ROW = 290, 110
PROCESS_BYTES = int(0.8 * 2**30)
EVAL_BYTES_PER_ROW = 48  # evaluate: labels, logits (float64 copies) and AUC ranks of every held-out row
OPTIMIZER_COPIES = 2  # weights + row-wise Adagrad state (and headroom for its gradient buffers)


def parse_overrides(text: str) -> dict[str, Any]:
    """'a.b=1,c=x' -> nested dict {'a': {'b': 1}, 'c': 'x'} (values parsed as YAML scalars or lists)."""
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(";" if ";" in text else ","))):
        if "=" not in item:
            raise ValueError(f"--set: {item!r} is not FIELD=VALUE (e.g. train.embedding_lr=0.1)")
        key, value = item.split("=", 1)
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return out


def parse_configs(text: str) -> dict[str, dict[str, Any]]:
    """'name:a=1,b=2;other:c=3' -> {name: overrides}; an empty override list is the defaults."""
    configs: dict[str, dict[str, Any]] = {}
    for part in filter(None, (s.strip() for s in text.split(";"))):
        name, _, body = part.partition(":")
        if not name.strip():
            raise ValueError(f"--configs: {part!r} has no name (NAME:FIELD=VALUE,...)")
        configs[name.strip()] = parse_overrides(body)
    return configs


WITHOUT_INDICATORS = "schema-missing"  # a bench-only preprocess_plan: the schema plan without its missing indicators


def no_indicator_plan(cfg: PipelineConfig, path: Path) -> Path:
    """Write the schema plan as it was before the missing indicators (every dense column's `missing_indicator`
    off): fill_null(0) -> log1p alone, where a missing count looks like a 0 (docs/performance.md#accuracy-of-the-
    defaults). The ablation of the default plan."""
    from recforge.preprocess.planning.plan import schema_plan  # lazy: torch

    dataset = cfg.dataset()
    for d in dataset.dense:
        d.missing_indicator = False
    plan = schema_plan(dataset, cfg.table_cap, cfg.hash_headroom)
    path.parent.mkdir(parents=True, exist_ok=True)
    plan.save(path)
    return path


def point_config(rows: int, overrides: dict[str, Any]) -> PipelineConfig:
    """The pipeline config of one point: the defaults, R rows per day, the overrides (validated by pydantic)."""
    base = PipelineConfig().model_dump(mode="json")
    merged = _merge(base, {"rows_per_day": rows, **overrides})
    return PipelineConfig.model_validate(merged)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def needs(cfg: PipelineConfig) -> dict[str, int]:
    """Peak memory and disk one point of this config needs (bytes), from the per-row costs above."""
    days = cfg.train_days + (1 if cfg.holdout == "next_day" else 0)
    rows = cfg.rows_per_day * days
    table_rows = sum(f.table_rows(cfg.table_cap, cfg.hash_headroom) for f in cfg.dataset().sparse)
    tables = table_rows * cfg.model.embedding_dim * 4 * OPTIMIZER_COPIES
    workers = cfg.resources.workers
    # the task process plus each worker (full tables in the worst plan: every table replicated), or evaluate
    memory = PROCESS_BYTES * (workers + 1) + tables * (workers + 1) + cfg.rows_per_day * EVAL_BYTES_PER_ROW
    disk = rows * (RAW_BYTES_PER_ROW + PARQUET_BYTES_PER_ROW)
    return {"memory_bytes": int(memory), "disk_bytes": int(disk)}


def refusal(cfg: PipelineConfig, memory_available: int, disk_free: int, cpus: int) -> str | None:
    """Why this machine cannot hold the point (None: it can), naming the limit."""
    need = needs(cfg)
    gib = 2**30
    if need["memory_bytes"] > memory_available:
        return (f"{cfg.rows_per_day} rows/day, table_cap {cfg.table_cap}, embedding_dim {cfg.model.embedding_dim}, "
                f"{cfg.resources.workers} workers need ~{need['memory_bytes'] / gib:.1f} GiB of memory; "
                f"{memory_available / gib:.1f} GiB is available (psutil.virtual_memory().available)")
    if need["disk_bytes"] > disk_free:
        return (f"{cfg.rows_per_day} rows/day need ~{need['disk_bytes'] / gib:.1f} GiB of disk for the day files "
                f"and shards; {disk_free / gib:.1f} GiB is free (shutil.disk_usage)")
    want = cfg.resources.workers * cfg.resources.threads_per_worker
    if want > cpus:
        return (f"{cfg.resources.workers} workers x {cfg.resources.threads_per_worker} threads need {want} cores; "
                f"this machine has {cpus} (os.cpu_count())")
    return None


def gap_fields(auc: float, ceiling: float | None) -> dict[str, Any]:
    """gap to the Bayes ceiling, share of the ceiling's lift over chance reached, and the goal's verdict."""
    if ceiling is None:
        return {"gap": None, "lift_reached": None, "within_goal": None}
    gap = ceiling - auc
    lift = (auc - 0.5) / (ceiling - 0.5) if ceiling > 0.5 else None
    return {"gap": gap, "lift_reached": lift, "within_goal": gap <= GOAL_GAP}


def schema_plan_ceiling(cfg: PipelineConfig, sample_rows: int = 200_000) -> dict[str, float]:
    """The Bayes AUC of the generator's hidden model (on a fresh sample of the run's model) next to the best AUC any
    model can reach from what the default (schema) plan shows it: fill_null(0) then log1p makes a missing count and
    a count <= 0 the same input, so the posterior mixes both cases (weighted by how often each happens)."""
    import itertools  # lazy: only here

    import numpy as np  # lazy: as above

    from recforge.data import generator as gen  # lazy: the generator's hidden model (its private parts, by intent)

    ds = cfg.dataset()
    days = cfg.train_days + (1 if cfg.holdout == "next_day" else 0)
    model = gen._build_model(ds, cfg.seed, gen.default_cardinality_scale(ds, cfg.rows_per_day * days))
    rng = np.random.default_rng(np.random.SeedSequence(cfg.seed, spawn_key=(9,)))
    dense, dmiss, _, _, z = gen._draw(ds, model, rng, sample_rows)
    y = rng.random(sample_rows) < gen._sigmoid(z)
    informative = np.flatnonzero((model.dense_w_log != 0) | (model.dense_w_pos != 0))
    rest = z.copy()
    looks_zero, p_missing, zero_term = {}, {}, {}
    for j in informative:
        x = dense[j]
        term = np.where(dmiss[j], 0.0, model.dense_w_log[j] * (np.log1p(np.maximum(x, 0)) - model.dense_center[j])
                        + model.dense_w_pos[j] * (x > 0))
        looks_zero[j] = dmiss[j] | (x <= 0)
        rest -= np.where(looks_zero[j], term, 0.0)  # the hidden part: which of the two cases it was
        p_missing[j] = float(dmiss[j][looks_zero[j]].mean()) if looks_zero[j].any() else 0.0
        zero_term[j] = -model.dense_w_log[j] * model.dense_center[j]  # the term of a real count <= 0
    posterior = np.zeros(sample_rows)
    for combo in itertools.product((0, 1), repeat=informative.size):  # 1: that column was missing
        weight, add = np.ones(sample_rows), np.zeros(sample_rows)
        for missing, j in zip(combo, informative, strict=True):
            weight *= np.where(looks_zero[j], p_missing[j] if missing else 1 - p_missing[j], 0.0 if missing else 1.0)
            add += np.where(looks_zero[j] & (missing == 0), zero_term[j], 0.0)
        posterior += weight * gen._sigmoid(rest + add)
    return {"bayes_auc_sample": gen.auc(y, gen._sigmoid(z)), "schema_plan_ceiling": gen.auc(y, posterior),
            "sample_rows": float(sample_rows)}


def run_point(home: Path, key: str, cfg: PipelineConfig, data_from: Path | None) -> dict[str, Any]:
    """The pipeline's stages for one point in `home`; with `data_from`, the generate/ingest outputs of that run
    (same rows) are reused instead of run again. Returns the point's record."""
    os.environ["RECFORGE_HOME"] = str(home)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{home / 'mlflow' / 'mlflow.db'}"
    os.environ["RECFORGE_MLFLOW_ARTIFACTS"] = str(home / "mlflow" / "artifacts")
    from recforge.pipelines.context import RunContext  # lazy: after RECFORGE_HOME points at this point's home
    from recforge.pipelines.runner import STAGE_FUNCTIONS  # lazy: as above

    ctx = RunContext.create(key, cfg, home=home)
    walls: dict[str, float] = {}
    outs: dict[str, Any] = {}
    for stage in STAGES:
        if data_from is not None and stage in DATA_STAGES:
            ctx.stage_dir(stage).mkdir(parents=True, exist_ok=True)
            shutil.copy(data_from / stage / "outputs.json", ctx.stage_dir(stage) / "outputs.json")
            continue
        t0 = time.perf_counter()
        outs[stage] = STAGE_FUNCTIONS[stage](ctx)
        walls[stage] = time.perf_counter() - t0
    from recforge.pipelines.outputs import IngestOutputs, PlanOutputs, TrainOutputs  # lazy: as above

    ev = outs["evaluate"]
    tr = ctx.read(TrainOutputs)
    ing = ctx.read(IngestOutputs)
    plan = ctx.read(PlanOutputs)
    trained = int(sum(tr.samples_trained))
    return {
        "rows": cfg.rows_per_day, "train_rows": ing.train.rows, "holdout_rows": ev.rows, "samples_trained": trained,
        "auc": ev.auc, "ceiling": ev.auc_ceiling, **gap_fields(ev.auc, ev.auc_ceiling),
        "logloss": ev.logloss, "ne": ev.ne, "stage_wall_s": walls, "train_wall_s": walls.get("train"),
        "train_samples_per_s": trained / walls["train"] if walls.get("train") else None,
        "workers": plan.workers, "threads_per_worker": plan.threads_per_worker,
        "preprocessing": _mode(plan), "run_dir": str(ctx.run_dir),
    }


def _mode(plan: Any) -> str | None:
    return plan.preprocessing.mode if plan.preprocessing is not None else None


def plot(report: dict[str, Any], path: Path) -> None:
    """AUC against training rows per config, with the Bayes ceiling of each point."""
    import matplotlib  # lazy: only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ceiling_drawn = False
    for name, points in report["curves"].items():
        pts = [p for p in points if "auc" in p]
        if not pts:
            continue
        xs = [p["train_rows"] for p in pts]
        ax.plot(xs, [p["auc"] for p in pts], marker="o", label=f"AUC ({name})")
        if not ceiling_drawn and all(p["ceiling"] is not None for p in pts):
            ax.plot(xs, [p["ceiling"] for p in pts], "k--", marker="x", label="Bayes ceiling")
            ax.fill_between(xs, [p["ceiling"] - GOAL_GAP for p in pts], [p["ceiling"] for p in pts],
                            color="grey", alpha=0.15, label=f"within {GOAL_GAP} of the ceiling")
            ceiling_drawn = True
            pc = report.get("plan_ceilings", {})
            shown = [(p["train_rows"], p["ceiling"] - pc[str(p["rows"])]["bayes_auc_sample"]
                      + pc[str(p["rows"])]["schema_plan_ceiling"]) for p in pts if str(p["rows"]) in pc]
            if shown:
                ax.plot(*zip(*shown, strict=True), "k:", marker="x", label="ceiling of what the schema plan shows")
    ax.set_xscale("log")
    ax.set_xlabel("training rows")
    ax.set_ylabel("held-out AUC (next day)")
    ax.set_title("recforge defaults: held-out AUC vs training rows")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(str(r) for r in DEFAULT_ROWS),
                    help="comma-separated training rows per point (one day each, plus the held-out next day)")
    ap.add_argument("--set", default="", help="config overrides for every point: FIELD=VALUE,... (dotted fields)")
    ap.add_argument("--configs", default="", help="named override sets on the same data: NAME:F=V,F=V;NAME2:...")
    ap.add_argument("--data-from", type=Path, default=None,
                    help="reuse the generate/ingest outputs of this earlier run dir (same rows; one row count)")
    ap.add_argument("--no-plan-ceiling", action="store_true",
                    help="skip the AUC ceiling of what the schema plan shows (a 200k-row sample of the hidden model)")
    ap.add_argument("--home", type=Path, default=None, help="keep the runs here (default: a temp dir, removed)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_accuracy.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "accuracy.png")
    args = ap.parse_args(argv)

    console = Console()
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    common = parse_overrides(args.set)
    configs = parse_configs(args.configs) or {"defaults": {}}
    points = {name: [point_config(r, _merge(common, over)) for r in rows] for name, over in configs.items()}
    # refuse what the machine cannot hold before anything starts
    root = args.home or Path(tempfile.mkdtemp(prefix="bench_accuracy_"))
    root.mkdir(parents=True, exist_ok=True)
    mem, disk, cpus = psutil.virtual_memory().available, shutil.disk_usage(root).free, os.cpu_count() or 1
    for name, cfgs in points.items():
        for cfg in cfgs:
            why = refusal(cfg, mem, disk, cpus)
            if why:
                console.print(f"[red]refused ({name}): {why}")
                if args.home is None:
                    shutil.rmtree(root, ignore_errors=True)
                return 2
    report: dict[str, Any] = {
        "bench": "accuracy", "started": datetime.now(UTC).isoformat(), "cpu_model": cpu_model(),
        "cpu_count": cpus, "loadavg_start": list(os.getloadavg()), "goal_gap": GOAL_GAP,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "configs": {name: _merge(common, over) for name, over in configs.items()},
        "defaults": {"model": PipelineConfig().model.model_dump(mode="json"),
                     "train": PipelineConfig().train.model_dump(mode="json"),
                     "table_cap": PipelineConfig().table_cap, "preprocess_plan": PipelineConfig().preprocess_plan},
        "curves": {name: [] for name in configs},
        "plan_ceilings": {},
    }
    total = len(rows) * len(configs)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task("accuracy", total=total)
            for r in rows:
                data_from: Path | None = args.data_from
                if not args.no_plan_ceiling:
                    bar.update(task, description=f"ceiling of the schema plan @ {r:,} rows")
                    report["plan_ceilings"][str(r)] = schema_plan_ceiling(next(iter(points.values()))[rows.index(r)])
                for name, cfgs in points.items():
                    cfg = next(c for c in cfgs if c.rows_per_day == r)
                    bar.update(task, description=f"{name} @ {r:,} rows")
                    key = f"acc_{r}_{name}"
                    home = root / key
                    if cfg.preprocess_plan == WITHOUT_INDICATORS:
                        path = no_indicator_plan(cfg, home / "plan_no_indicators.json")
                        cfg = cfg.model_copy(update={"preprocess_plan": str(path)})
                    t0 = time.perf_counter()
                    try:
                        rec = run_point(home, key, cfg, data_from)
                    except Exception as e:  # a failed point is reported, the curve goes on (not a cancelled run)
                        if type(e).__name__ == "JobCancelled":
                            raise
                        rec = {"rows": r, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
                    rec["wall_s"] = time.perf_counter() - t0
                    rec["loadavg"] = list(os.getloadavg())
                    report["curves"][name].append(rec)
                    if "auc" in rec and data_from is None:
                        data_from = home / "runs" / "recforge_daily" / key
                    bar.advance(task)
                    msg = (f"auc {rec['auc']:.4f} ceiling {rec['ceiling']:.4f} gap {rec['gap']:+.4f} "
                           f"train {rec['train_wall_s']:.0f}s" if "auc" in rec else rec["error"][:300])
                    console.print(f"{name} @ {r:,} rows: {msg}")
                    write_report(args.out, report)  # partial reports survive a stopped run
                plot(report, args.plot)  # the curve so far, after each row count
    finally:
        if args.home is None:
            shutil.rmtree(root, ignore_errors=True)
    report["loadavg_end"] = list(os.getloadavg())
    report["finished"] = datetime.now(UTC).isoformat()
    write_report(args.out, report)
    console.print(json.dumps({n: [(p["rows"], round(p.get("auc", float("nan")), 4),
                                   round(p.get("ceiling") or float("nan"), 4)) for p in pts]
                              for n, pts in report["curves"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
