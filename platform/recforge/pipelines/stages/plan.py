"""Resource planning (the elastic.Policy seam) and the preprocessing plan the workers will run."""
from __future__ import annotations

from recforge.elastic.policy import StaticPolicy
from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import CorunPlan, IngestOutputs, PlanOutputs, PreprocessingChoice
from recforge.pipelines.stage import run_stage
from recforge.preprocess.presets import load_plan
from recforge.preprocess.run_params import preprocess_params
from recforge.rap.planning.choice import choose_mode


def plan_resources(ctx: RunContext) -> PlanOutputs:
    def body(w, store, run_id):

        cfg = ctx.config
        plan = load_plan(cfg.preprocess_plan, cfg.dataset(), cfg.table_cap, cfg.hash_headroom)  # "schema": schema_plan
        plan_path = w.tmp / "preprocess_plan.json"
        plan.save(plan_path)
        params, summary = preprocess_params(plan, cfg.dataset(), cfg.preprocess_executor, cfg.preprocess_plan)
        store.log_params(run_id, params)  # executor, plan, fused groups (and DALI's fallbacks)
        store.log_dict(run_id, summary, "preprocess_groups.json")
        resources = StaticPolicy(cfg.resources).plan(None)
        dlrover = None
        if cfg.resources.policy == "dlrover":  # DLRover-RM stage 1: warm start from MLflow history (logs its events)
            from recforge.pipelines.hooks.resource_planning import plan_with_dlrover  # lazy: mlflow off the UI/CLI path
            rows = ctx.read(IngestOutputs).train.rows
            resources, dlrover = plan_with_dlrover(store, run_id, cfg, plan.tables(), rows)
        store.log_params(run_id, {"policy": cfg.resources.policy, "workers": resources.workers,
                                  "threads_per_worker": resources.threads_per_worker})
        store.log_artifact(run_id, plan_path)
        corun = rap_schedule = None
        if cfg.preprocessing in ("auto", "corun"):  # RAP: profile, predict, choose; the co-run schedule if chosen
            from recforge.pipelines.hooks.rap_planning import (
                plan_preprocessing,  # lazy: torch off the UI/CLI import path
            )
            planned = plan_preprocessing(store, run_id, cfg, plan, resources.workers, w,
                                         manifest_dir=ctx.read(IngestOutputs).train.manifest_dir,
                                         trainer_threads=resources.threads_per_worker)  # cold: bound, else profile
            choice = planned.choice
            corun = CorunPlan.model_validate(planned.corun) if planned.corun is not None else None
            rap_schedule = planned.rap_schedule
        else:  # inline / offline as configured: nothing to predict
            choice = choose_mode(cfg.preprocessing)
            store.log_params(run_id, {"preprocessing_requested": choice.requested})
            store.set_tags(run_id, {"preprocessing_mode": choice.mode, "preprocessing_reason": choice.reason})
        # the fused groups the workers run (the page's "Fused groups"): what the fused executor (co-run, or the
        # fused / DALI executor inline) launches; the eager executor launches per op
        fusion = summary if choice.mode == "corun" or cfg.preprocess_executor in ("fused", "dali") else None
        return PlanOutputs(
            plan_path=str(w.final / "preprocess_plan.json"), workers=resources.workers,
            threads_per_worker=resources.threads_per_worker, tables=plan.tables(),
            num_dense=len(plan.dense_features()), preprocess_executor=cfg.preprocess_executor, dlrover=dlrover,
            preprocessing=PreprocessingChoice(requested=choice.requested, mode=choice.mode, reason=choice.reason,
                                              predicted_inline_ms=choice.predicted_inline_ms,
                                              predicted_corun_ms=choice.predicted_corun_ms, bound=choice.bound),
            corun=corun, rap_schedule=rap_schedule, fusion=fusion,
        )

    return run_stage(ctx, PlanOutputs, body)
