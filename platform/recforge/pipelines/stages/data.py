"""Stages that produce data: synthetic day files, then validated Parquet shards."""
from __future__ import annotations

from pathlib import Path

from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import GenerateOutputs, IngestOutputs, SplitOutputs
from recforge.pipelines.stage import run_stage


def generate(ctx: RunContext) -> GenerateOutputs:
    """Raw day files: the user's `source_dir`, or synthetic Criteo-format days (train days + one held out)."""

    def body(w, store, run_id):
        cfg = ctx.config
        days = cfg.train_days + 1
        if cfg.source_dir:
            files = sorted(str(p) for p in Path(cfg.source_dir).glob("day_*.tsv*"))
            if len(files) < days:
                raise FileNotFoundError(
                    f"source_dir {cfg.source_dir}: need {days} day files (day_*.tsv[.gz]), found {len(files)}"
                )
            return GenerateOutputs(files=files[:days], synthetic=False)
        from recforge.data.generator import generate_days  # lazy: numpy, pyarrow off the CLI/DAG import path

        report = generate_days(cfg.dataset(), w.tmp / "raw", days=days, rows_per_day=cfg.rows_per_day, seed=cfg.seed,
                               first_day=ctx.data_day)
        store.log_metrics(run_id, {"rows_per_day": cfg.rows_per_day, "bayes_auc_holdout": report.bayes_auc[-1],
                                   "first_day": ctx.data_day})
        files = [str(w.final / "raw" / Path(f).name) for f in report.files]
        return GenerateOutputs(files=files, synthetic=True, bayes_auc=list(report.bayes_auc),
                               positive_rate=list(report.positive_rate))

    return run_stage(ctx, GenerateOutputs, body)


def ingest(ctx: RunContext) -> IngestOutputs:
    """Validate raw days into Parquet shards: all but the last day for training, the last one held out."""
    files = [Path(f) for f in ctx.read(GenerateOutputs).files]

    def body(w, store, run_id):
        from recforge.data.ingest import ingest as ingest_files  # lazy: pyarrow off the CLI/DAG import path

        cfg = ctx.config
        dataset = cfg.dataset()
        out: dict[str, SplitOutputs] = {}
        for split, sources in (("train", files[:-1]), ("holdout", files[-1:])):
            manifest = ingest_files(
                sources, dataset, w.tmp / split,
                rows_per_shard=cfg.rows_per_shard, max_bad_fraction=cfg.max_bad_fraction,
            )
            out[split] = SplitOutputs(manifest_dir=str(w.final / split), rows=manifest.total_rows,
                                      quarantined=manifest.quarantined_rows, shards=len(manifest.shards))
            store.log_metrics(run_id, {f"{split}_rows": manifest.total_rows,
                                       f"{split}_quarantined": manifest.quarantined_rows})
            store.log_artifact(run_id, w.tmp / split / "manifest.json", split)
        train, holdout = out["train"], out["holdout"]
        return IngestOutputs(train=train, holdout=holdout, rows_ingested=train.rows + holdout.rows,
                             rows_quarantined=train.quarantined + holdout.quarantined)

    return run_stage(ctx, IngestOutputs, body)
