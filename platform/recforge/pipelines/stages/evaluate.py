"""Evaluate the trained model on the held-out day (and the champion on the same day, for the promotion gate)."""
from __future__ import annotations

from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import EvaluateOutputs, GenerateOutputs, IngestOutputs
from recforge.pipelines.stage import run_stage
from recforge.pipelines.stages.train import load_trained


def evaluate(ctx: RunContext) -> EvaluateOutputs:
    data = ctx.read(IngestOutputs)
    ceiling = ctx.read(GenerateOutputs).bayes_auc

    def body(w, store, run_id):
        from recforge.preprocess.executor import TorchExecutor  # lazy: torch off the UI/CLI import path
        from recforge.train.metrics import evaluate as evaluate_model  # lazy: torch off the UI/CLI import path

        model, plan = load_trained(ctx)
        executor = TorchExecutor(plan, ctx.config.dataset())
        metrics = evaluate_model(model, executor, data.holdout.manifest_dir, batch_size=4096)
        out = EvaluateOutputs(auc=metrics["auc"], logloss=metrics["logloss"], ne=metrics["ne"], rows=metrics["rows"],
                              auc_ceiling=ceiling[-1] if ceiling else None)
        store.log_metrics(run_id, out.model_dump(include={"auc", "logloss", "ne", "rows", "auc_ceiling"},
                                                 exclude_none=True))
        return out

    return run_stage(ctx, EvaluateOutputs, body)
