"""Stages that produce data: the run's day files (landing zone or synthetic), then validated Parquet shards."""
from __future__ import annotations

from datetime import date
from pathlib import Path

from recforge.pipelines import landing
from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import GenerateOutputs, IngestOutputs, SplitOutputs
from recforge.pipelines.stage import run_stage


def generate(ctx: RunContext) -> GenerateOutputs:
    """Raw day files of the run's window (landing.window): the landing zone's (source_uri: local files used where
    they are, remote ones copied into the run), or synthetic Criteo-format days (source_uri empty: the demo's)."""

    def body(w, store, run_id):
        cfg = ctx.config
        if cfg.source_uri:
            return _landed(ctx, w, store, run_id)
        from recforge.data.generator import generate_days  # lazy: numpy, pyarrow off the CLI/DAG import path

        days = cfg.train_days + (1 if cfg.holdout == "next_day" else 0)
        report = generate_days(cfg.dataset(), w.tmp / "raw", days=days, rows_per_day=cfg.rows_per_day, seed=cfg.seed,
                               first_day=ctx.data_day)
        store.log_metrics(run_id, {"rows_per_day": cfg.rows_per_day, "bayes_auc_holdout": report.bayes_auc[-1],
                                   "first_day": ctx.data_day})
        files = [str(w.final / "raw" / Path(f).name) for f in report.files]
        dated = ctx.data_day >= 1
        return GenerateOutputs(
            files=files, synthetic=True, bayes_auc=list(report.bayes_auc), positive_rate=list(report.positive_rate),
            run_day=landing.run_day(ctx.data_day, cfg).isoformat() if dated else None,
            days=[date.fromordinal(ctx.data_day + i).isoformat() for i in range(days)] if dated else None,
            holdout=cfg.holdout)

    return run_stage(ctx, GenerateOutputs, body)


def _landed(ctx: RunContext, w, store, run_id) -> GenerateOutputs:
    """The run's landing files (the DAG's wait_for_data saw them land); a synthetic day's report (land_synthetic)
    gives the Bayes AUC ceiling."""
    cfg = ctx.config
    day = landing.run_day(ctx.data_day, cfg)
    found = landing.resolve(cfg, day)
    files = landing.fetch(found, w.tmp / "raw", w.final / "raw")
    reports = [landing.read_sidecar(f.url) for f in found]
    bayes = [float(r["bayes_auc"]) for r in reports if r] if all(reports) else None
    rates = [float(r["positive_rate"]) for r in reports if r] if all(reports) else None
    store.log_dict(run_id, {"run_day": day.isoformat(), "source_uri": cfg.source_uri,
                            "files": [{"day": f.day, "role": f.role, "url": f.url, "path": p}
                                      for f, p in zip(found, files, strict=True)]}, "landing.json")
    store.log_metrics(run_id, {"landing_files": len(found), **({"bayes_auc_holdout": bayes[-1]} if bayes else {})})
    return GenerateOutputs(files=files, synthetic=False, bayes_auc=bayes, positive_rate=rates,
                           run_day=day.isoformat(), days=[f.day for f in found], sources=[f.url for f in found],
                           holdout=cfg.holdout)


def ingest(ctx: RunContext) -> IngestOutputs:
    """Validate raw days into Parquet shards: the training days, and the held-out rows (holdout setting: the next
    day's files, or the last rows of the run's day)."""
    gen = ctx.read(GenerateOutputs)
    train_files, holdout_files, run_day_files = landing.split_files(gen.files, gen.days, gen.holdout)

    def body(w, store, run_id):
        from recforge.data.ingest import ingest as ingest_files  # lazy: pyarrow off the CLI/DAG import path

        cfg = ctx.config
        dataset = cfg.dataset()
        out: dict[str, SplitOutputs] = {}
        manifests = {split: ingest_files([Path(f) for f in sources], dataset, w.tmp / split,
                                         rows_per_shard=cfg.rows_per_shard, max_bad_fraction=cfg.max_bad_fraction)
                     for split, sources in (("train", train_files), ("holdout", holdout_files)) if sources}
        if not holdout_files:  # holdout split: the run day's last rows move from the train split
            from recforge.pipelines.holdout import hold_out_tail  # lazy: pyarrow off the CLI/DAG import path

            manifests["train"], manifests["holdout"] = hold_out_tail(w.tmp / "train", w.tmp / "holdout",
                                                                     run_day_files, cfg.holdout_fraction)
        for split, manifest in manifests.items():
            out[split] = SplitOutputs(manifest_dir=str(w.final / split), rows=manifest.total_rows,
                                      quarantined=manifest.quarantined_rows, shards=len(manifest.shards))
            store.log_metrics(run_id, {f"{split}_rows": manifest.total_rows,
                                       f"{split}_quarantined": manifest.quarantined_rows})
            store.log_artifact(run_id, w.tmp / split / "manifest.json", split)
        train, holdout = out["train"], out["holdout"]
        # column statistics of the training day(s) and drift against the previous day: reported, never a failure
        from recforge.pipelines.hooks.data_stats import record_data_stats  # lazy: pyarrow, matplotlib

        stats = record_data_stats(ctx, store, run_id, w.tmp / "train", "train")
        return IngestOutputs(train=train, holdout=holdout, rows_ingested=train.rows + holdout.rows,
                             rows_quarantined=train.quarantined + holdout.quarantined, stats=stats)

    return run_stage(ctx, IngestOutputs, body)
