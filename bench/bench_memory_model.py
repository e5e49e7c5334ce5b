"""Held-out error of DLRover-RM's memory model (per-worker peak memory), leave one run out.

Two sets of measured runs:
  - the committed trainer profile (bench/profile_trainer.py): every point is a real training job whose
    workers' peak RSS was sampled;
  - with --home (a RECFORGE_HOME) or --tracking-uri: the daily pipeline's train runs under policy dlrover,
    whose workers report their peak RSS (WorkerResult.peak_rss_bytes) and whose records keep the points.
For each, the model is fitted on all runs but one and predicts the held-out run's peaks; the report gives
the mean relative error, the worst run, and the error the old constant model (0.5 GiB + 2x shard) makes
on the same points.

    python bench/bench_memory_model.py [--home ~/.recforge] [--dataset criteo_kaggle --family dlrm]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from _results import write_report  # bench/_results.py (bench/ is the script's directory)
from recforge.elastic.optimizer.models.memory_model import (
    DEFAULT_MEMORY_MODEL,
    MemorySample,
    fit_or_prior,
    leave_one_run_out,
    profile_memory_samples,
    samples_from_dicts,
)


def evaluate(name: str, samples: list[MemorySample]) -> dict:
    runs = sorted({s.run for s in samples})
    out: dict = {"set": name, "runs": len(runs), "points": len(samples)}
    if not samples:
        out["note"] = "no measured points"
        return out
    const = [abs(DEFAULT_MEMORY_MODEL.predict(s.embedding_bytes, s.step) - s.rss_bytes) / s.rss_bytes
             for s in samples]
    out["constant_model_mape"] = float(np.mean(const))
    out["model"] = fit_or_prior(samples, DEFAULT_MEMORY_MODEL).to_dict()
    loo = leave_one_run_out(samples, DEFAULT_MEMORY_MODEL)
    if loo is None:
        out["note"] = "fewer than two runs: no held-out error"
        return out
    worst = max(loo["per_run"].items(), key=lambda kv: kv[1])
    out.update({"loo_mape": loo["mape"], "worst_run": {"run": worst[0], "mape": worst[1]},
                "median_run_mape": float(np.median(list(loo["per_run"].values())))})
    return out


def pipeline_samples(dataset: str, family: str) -> list[MemorySample]:
    from recforge.elastic.optimizer.models.resource_store import MlflowHistory
    from recforge.tracking import TrackingStore

    history = MlflowHistory(TrackingStore(), max_runs=500)
    out: list[MemorySample] = []
    for rec in history.similar(dataset, family, limit=500):
        out += samples_from_dicts(rec.extra.get("memory_points") or [], run=rec.run_id or "")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", type=Path, help="RECFORGE_HOME whose MLflow store holds pipeline runs")
    ap.add_argument("--tracking-uri", help="an MLflow tracking URI instead of --home's")
    ap.add_argument("--dataset", default="criteo_kaggle")
    ap.add_argument("--family", default="dlrm")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results"
                    / f"memory_model_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json")
    args = ap.parse_args(argv)
    if args.home:
        os.environ["RECFORGE_HOME"] = str(args.home)
    if args.tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = args.tracking_uri
    sets = [evaluate("committed profile", profile_memory_samples())]
    if args.home or args.tracking_uri:
        sets.append(evaluate(f"pipeline runs {args.dataset}/{args.family}", pipeline_samples(args.dataset,
                                                                                             args.family)))
    for s in sets:
        loo = f"{s['loo_mape']:.1%}" if "loo_mape" in s else "n/a"
        const = f"{s['constant_model_mape']:.1%}" if "constant_model_mape" in s else "n/a"
        print(f"{s['set']}: {s['runs']} runs, {s['points']} points; leave-one-run-out error {loo} "
              f"(constant model: {const}){'; ' + s['note'] if 'note' in s else ''}")
    write_report(args.out, {"sets": sets})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
