"""Evaluate the trained model on the held-out day, and the champion on the same day (for the promotion gate).

A model whose logits or metrics are NaN/inf fails the stage (recforge.train.metrics.NonFiniteMetricsError): it is
never recorded as evaluated. A champion that cannot be loaded or scored is recorded with the reason; the gate then
decides on the absolute checks alone (docs/champion_gate.md)."""
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
PLAN_ARTIFACT = "plan/preprocess_plan.json"  # publish logs the plan a registered model was trained on here


class NonFiniteModelError(InvalidInput):
    """The trained model's logits or metrics are NaN/inf: evaluate fails at once (a retry computes the same)."""


def evaluate(ctx: RunContext) -> EvaluateOutputs:
    data = ctx.read(IngestOutputs)
    ceiling = ctx.read(GenerateOutputs).bayes_auc

    def body(w, store, run_id):
        from recforge.preprocess.executor import TorchExecutor  # lazy: torch off the UI/CLI import path
        from recforge.train.metrics import NonFiniteMetricsError  # lazy: torch off the UI/CLI import path
        from recforge.train.metrics import evaluate as evaluate_model  # lazy: torch off the UI/CLI import path

        model, plan = load_trained(ctx)  # a checkpoint that fails its checks raises here: the stage fails
        executor = TorchExecutor(plan, ctx.config.dataset())
        try:
            metrics = evaluate_model(model, executor, data.holdout.manifest_dir, batch_size=BATCH_SIZE)
        except NonFiniteMetricsError as e:
            raise NonFiniteModelError(f"evaluate: the trained model of run {ctx.run_key} "
                                      f"({ctx.read(TrainOutputs).checkpoint_dir}) cannot be evaluated: {e}") from e
        version, score, problem = score_champion(ctx, store, w.tmp / "champion")
        out = EvaluateOutputs(auc=metrics["auc"], logloss=metrics["logloss"], ne=metrics["ne"], rows=metrics["rows"],
                              auc_ceiling=ceiling[-1] if ceiling else None, champion=score,
                              champion_version=version, champion_problem=problem)
        store.log_metrics(run_id, out.model_dump(include={"auc", "logloss", "ne", "rows", "auc_ceiling"},
                                                 exclude_none=True))
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
    from recforge.train.metrics import evaluate as evaluate_model  # lazy: torch off the UI/CLI import path

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
        m = evaluate_model(model, TorchExecutor(plan, dataset), holdout, batch_size=BATCH_SIZE)
    except Exception as e:  # any of these leaves the champion unscored, with the reason; the gate decides
        problem = f"{step}: {type(e).__name__}: {str(e)[:400]}"
        log.warning("champion v%s could not be scored on %s (%s)", ref.version, holdout, problem)
        return ref.version, None, problem
    return ref.version, ChampionScore(version=ref.version, auc=m["auc"], logloss=m["logloss"], rows=m["rows"]), None


def log_champion(store: Any, run_id: str, version: str | None, score: ChampionScore | None,
                 problem: str | None) -> None:
    """The champion's score on this day in the run's MLflow run (metrics champion_*, tags champion.*)."""
    if score is not None:
        store.log_metrics(run_id, {"champion_auc": score.auc, "champion_logloss": score.logloss,
                                   "champion_rows": score.rows})
    store.set_tags(run_id, {"champion.version": version or "none",
                            **({"champion.problem": problem[:5000]} if problem else {})})
