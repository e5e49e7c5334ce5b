"""Evaluate the trained model on the held-out day, and the champion on the same day (for the promotion gate).

A model whose logits or metrics are NaN/inf fails the stage (recforge.train.metrics.NonFiniteMetricsError): it is
never recorded as evaluated. A champion that cannot be loaded or scored is recorded with the reason; the gate then
decides on the absolute checks alone (docs/champion_gate.md).

Both scores stream the held-out day (stream_metrics): a slab of rows at a time, logloss summed exactly and the AUC
from fixed-size probability bins, so a day of any size is scored in flat memory
(docs/performance.md#the-daily-pipeline-at-scale)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from recforge.pipelines.context import RunContext
from recforge.pipelines.hooks.warm_start import REGISTERED_MODEL
from recforge.pipelines.outputs import ChampionScore, EvaluateOutputs, GenerateOutputs, IngestOutputs, TrainOutputs
from recforge.pipelines.stage import InvalidInput, run_stage
from recforge.pipelines.stages.train import load_trained

log = logging.getLogger("recforge.pipelines")

BATCH_SIZE = 4096
SLAB_ROWS = 65536  # rows read from a shard at once by stream_metrics
PLAN_ARTIFACT = "plan/preprocess_plan.json"  # publish logs the plan a registered model was trained on here


class NonFiniteModelError(InvalidInput):
    """The trained model's logits or metrics are NaN/inf: evaluate fails at once (a retry computes the same)."""


def evaluate(ctx: RunContext) -> EvaluateOutputs:
    data = ctx.read(IngestOutputs)
    ceiling = ctx.read(GenerateOutputs).bayes_auc

    def body(w, store, run_id):
        from recforge.preprocess.executor import TorchExecutor  # lazy: torch off the UI/CLI import path
        from recforge.train.metrics import NonFiniteMetricsError  # lazy: torch off the UI/CLI import path

        model, plan = load_trained(ctx)  # a checkpoint that fails its checks raises here: the stage fails
        executor = TorchExecutor(plan, ctx.config.dataset())
        try:
            metrics = stream_metrics(model, executor, data.holdout.manifest_dir, batch_size=BATCH_SIZE)
        except NonFiniteMetricsError as e:
            raise NonFiniteModelError(f"evaluate: the trained model of run {ctx.run_key} "
                                      f"({ctx.read(TrainOutputs).checkpoint_dir}) cannot be evaluated: {e}") from e
        version, score, problem = score_champion(ctx, store, w.tmp / "champion")
        out = EvaluateOutputs(auc=metrics["auc"], logloss=metrics["logloss"], ne=metrics["ne"], rows=metrics["rows"],
                              auc_ceiling=ceiling[-1] if ceiling else None, champion=score,
                              champion_version=version, champion_problem=problem)
        store.log_metrics(run_id, out.model_dump(include={"auc", "logloss", "ne", "rows", "auc_ceiling"},
                                                 exclude_none=True))
        store.log_metrics(run_id, {"auc_bin_error_bound": metrics["auc_error_bound"]})
        log_champion(store, run_id, version, score, problem)
        return out

    return run_stage(ctx, EvaluateOutputs, body)


def score_champion(ctx: RunContext, store: Any,
                   scratch: Path) -> tuple[str | None, ChampionScore | None, str | None]:
    """(version, score, problem) of the current champion on this run's held-out day: (None, None, None) when there
    is none; a champion that cannot be loaded or scored (its plan or model artifact missing or broken, another
    schema, NaN outputs) gives (version, None, why). Reading the registry itself is not caught: that fails the stage
    (and Airflow retries it)."""
    from recforge.preprocess.executor import TorchExecutor  # lazy: torch off the UI/CLI import path
    from recforge.preprocess.planning.plan import Plan  # lazy: as above
    from recforge.tracking.registry import ModelRegistry  # lazy: mlflow off the UI/CLI import path

    registry = ModelRegistry(store, REGISTERED_MODEL)
    ref = registry.champion_ref()
    if ref is None:
        return None, None, None
    holdout = ctx.read(IngestOutputs).holdout.manifest_dir
    step = "reading its plan"
    try:
        plan = Plan.load(registry.download(ref.version, PLAN_ARTIFACT, scratch))
        step = "checking its plan against this run's dataset"
        dataset = ctx.config.dataset()
        plan.validate_for(dataset)
        step = "loading its model"
        model = registry.load(ref.version)
        step = "scoring it"
        m = stream_metrics(model, TorchExecutor(plan, dataset), holdout, batch_size=BATCH_SIZE)
    except Exception as e:  # any of these leaves the champion unscored, with the reason; the gate decides
        problem = f"{step}: {type(e).__name__}: {str(e)[:400]}"
        log.warning("champion v%s could not be scored on %s (%s)", ref.version, holdout, problem)
        return ref.version, None, problem
    return ref.version, ChampionScore(version=ref.version, auc=m["auc"], logloss=m["logloss"], rows=m["rows"]), None


def stream_metrics(model: Any, executor: Any, manifest_dir: str | Path, batch_size: int = BATCH_SIZE,
                   slab_rows: int = SLAB_ROWS) -> dict[str, float]:
    """{auc, logloss, ne, rows, auc_error_bound} of `model` (logits out) on every row of the manifest, read
    `slab_rows` at a time (recforge.data.shards.iter_shard: each shard opened for its walk only) and scored
    `batch_size` rows at a time: memory does not grow with the day. logloss and NE are summed exactly; the AUC
    comes from recforge.data.binned_auc.StreamingAuc (within auc_error_bound of the rank AUC).
    NonFiniteMetricsError on a NaN/inf logit (naming the row); ValueError on a shard whose rows differ from its
    manifest."""
    import numpy as np  # lazy: numpy off the UI/CLI import path
    import torch  # lazy: torch off the UI/CLI import path

    from recforge.data.binned_auc import StreamingAuc  # lazy: numpy off the UI/CLI import path
    from recforge.data.shards import iter_shard, open_manifest  # lazy: pyarrow off the UI/CLI import path
    from recforge.preprocess.batch import RawBatch  # lazy: torch off the UI/CLI import path
    from recforge.train.loop.batches import slice_raw  # lazy: torch off the UI/CLI import path
    from recforge.train.metrics import NonFiniteMetricsError  # lazy: torch off the UI/CLI import path

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    slab_rows = max(batch_size, slab_rows // batch_size * batch_size)
    manifest = open_manifest(manifest_dir)
    scored = StreamingAuc()
    rows = positives = 0
    loss_sum = 0.0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i, shard in enumerate(manifest.shards):
                lo = 0
                for record_batch in iter_shard(manifest_dir, i, slab_rows):
                    slab = RawBatch.from_arrow(record_batch, manifest.dataset)
                    for start in range(0, slab.rows, batch_size):
                        raw = slice_raw(slab, start, min(start + batch_size, slab.rows))
                        z = model(*executor(raw)).reshape(-1).double().cpu().numpy()
                        y = raw.label.numpy().astype(np.float64).reshape(-1)
                        bad = ~np.isfinite(z)
                        if bad.any():
                            first = int(np.flatnonzero(bad)[0])
                            raise NonFiniteMetricsError(
                                f"the model's logits are not finite on {int(bad.sum())} of {z.size} rows of shard "
                                f"{shard.path} of {manifest_dir} (first: row {lo + start + first}, {z[first]}): "
                                "its weights hold NaN/inf; no metric is recorded for it")
                        if not np.isin(y, (0.0, 1.0)).all():
                            raise ValueError(f"labels must be 0 or 1 (shard {shard.path} of {manifest_dir}, "
                                             f"rows {lo + start}..{lo + start + y.size - 1})")
                        loss_sum += float((np.logaddexp(0.0, z) - y * z).sum())
                        scored.update(y, 1.0 / (1.0 + np.exp(-z)))
                        rows += y.size
                        positives += int(y.sum())
                    lo += slab.rows
                if lo != shard.rows:
                    raise ValueError(f"shard {shard.path} of {manifest_dir} holds {lo} rows, its manifest says "
                                     f"{shard.rows}: the shard was changed after ingest")
    finally:
        model.train(was_training)
    if rows == 0:
        raise ValueError(f"manifest {manifest_dir} has no rows to evaluate")
    if positives in (0, rows):
        raise ValueError(f"the held-out rows of {manifest_dir} have only one label ({positives} of {rows} positive): "
                         "AUC and normalized entropy need both")
    rate = positives / rows
    logloss = loss_sum / rows
    out = {"auc": scored.auc(), "logloss": logloss,
           "ne": logloss / -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate)), "rows": rows,
           "auc_error_bound": scored.error_bound()}
    nonfinite = {k: v for k, v in out.items() if not np.isfinite(v)}
    if nonfinite:
        raise NonFiniteMetricsError(f"metrics {nonfinite} on {manifest_dir} are not finite")
    return out


def log_champion(store: Any, run_id: str, version: str | None, score: ChampionScore | None,
                 problem: str | None) -> None:
    """The champion's score on this day in the run's MLflow run (metrics champion_*, tags champion.*)."""
    if score is not None:
        store.log_metrics(run_id, {"champion_auc": score.auc, "champion_logloss": score.logloss,
                                   "champion_rows": score.rows})
    store.set_tags(run_id, {"champion.version": version or "none",
                            **({"champion.problem": problem[:5000]} if problem else {})})
