"""Pipeline runs as the stages record them (StageWriter, the outputs models), for the summary and page tests:
a co-run run that used every system, an inline run that used none of the optional ones, a run whose train stage
failed and one whose train stage is still running. `ids` (MLflow run ids per stage) are optional: without MLflow
the outputs carry none."""
from __future__ import annotations

import json

from recforge.pipelines.context import RunContext, StageWriter
from recforge.pipelines.outputs import (
    ChampionScore,
    CheckpointRecord,
    CompileOutputs,
    CorunPlan,
    DLRoverRun,
    EvaluateOutputs,
    ExecutedDecision,
    ExecutorRecord,
    GenerateOutputs,
    IngestOutputs,
    MappingSummary,
    MemoryMeasurement,
    PlanMeasurement,
    PlanOutputs,
    PreprocessingChoice,
    ProfileSummary,
    PublishOutputs,
    SplitOutputs,
    StageOutputs,
    TrainOutputs,
    WarmStartRecord,
)

CORUN, INLINE, FAILED, RUNNING = "corun_run", "inline_run", "failed_run", "running_run"
TRAIN_ERROR = "JobFailedError: worker 1 exited with code 137 (OOM killed) after 3 restarts"
RAP_STAGES = ("emb_fwd", "mlp_fwd", "mlp_bwd", "emb_bwd", "allreduce")
STAGE_MS = {"emb_fwd": 4.0, "mlp_fwd": 2.0, "mlp_bwd": 3.0, "emb_bwd": 5.0, "allreduce": 1.0}
CAPACITY_MS = {"emb_fwd": 3.0, "mlp_fwd": 2.0, "mlp_bwd": 3.0, "emb_bwd": 0.0, "allreduce": 1.0}
GROUPS = ["L0:fill_null_densex13", "L1:sigrid_hash_sparsex26", "L2:firstx_sparsex26"]
GiB = 2**30


def write(ctx: RunContext, outputs: StageOutputs, run_id: str | None = None) -> StageOutputs:
    return StageWriter(ctx, outputs.stage).commit(outputs.model_copy(update={"mlflow_run_id": run_id}))


def _split(rows: int) -> SplitOutputs:
    return SplitOutputs(manifest_dir="unused", rows=rows, quarantined=0, shards=1)


def _job(workers: int) -> dict:
    return {"exit_code": 0, "plan": {"workers": workers, "threads_per_worker": 1}, "finished": True, "tasks_done": 4,
            "samples": 3000, "per_worker": {}, "poisoned": [], "master_state": {}}


def data_stages(ctx: RunContext, ids: dict | None = None) -> None:
    ids = ids or {}
    write(ctx, GenerateOutputs(files=["day_0.tsv", "day_1.tsv"], bayes_auc=[0.79, 0.78], synthetic=True),
          ids.get("generate"))
    write(ctx, IngestOutputs(train=_split(3000), holdout=_split(3000), rows_ingested=6000, rows_quarantined=0),
          ids.get("ingest"))


def corun_plan(ctx: RunContext, ids: dict | None = None, plan_file: dict | None = None,
               rap_schedule: dict | None = None) -> PlanOutputs:
    """plan_resources of an auto run that chose co-run with the mapping at 2 workers, under DLRover-RM. The Gantt
    comes from the schedule file unless `rap_schedule` is given."""
    w = StageWriter(ctx, "plan_resources")
    (w.tmp / "preprocess_plan.json").write_text(json.dumps(plan_file or {"name": "plan0", "features": []}))
    schedule = {"version": 1, "plan_name": "plan0", "stages": list(RAP_STAGES), "meta": {}, "assignments": [
        {"stage": "emb_fwd", "group": GROUPS[0], "features": ["I1"], "predicted_ms": 1.5},
        {"stage": "emb_fwd", "group": GROUPS[1], "features": ["C1"], "predicted_ms": 2.5},  # past capacity 3.0
        {"stage": "mlp_bwd", "group": GROUPS[2], "features": ["C1"], "predicted_ms": 1.0}]}
    (w.tmp / "corun_schedule.json").write_text(json.dumps(schedule))
    return w.commit(PlanOutputs(
        plan_path=str(w.final / "preprocess_plan.json"), workers=2, threads_per_worker=1, tables=[("C1", 5000)],
        num_dense=13, preprocess_executor="fused", mlflow_run_id=(ids or {}).get("plan_resources"),
        dlrover={"plan": {"workers": 2, "cpu_per_worker": 1.0, "memory_per_worker": 0.75 * GiB}},
        preprocessing=PreprocessingChoice(requested="auto", mode="corun", reason="co-run 15.5 ms < inline 21.0 ms",
                                          predicted_inline_ms=21.0, predicted_corun_ms=15.5),
        corun=CorunPlan(schedule_path=str(w.final / "corun_schedule.json"), source="RAP scheduler over stage profile",
                        predicted_iteration_ms=16.0, threads=1,
                        profile=ProfileSummary(key="k", origin="measured now", threshold=0.1, stage_ms=STAGE_MS,
                                               capacity_ms=CAPACITY_MS),
                        mapping_path=str(w.final / "mapping.json"),
                        mapping=MappingSummary(placed_by="mapping MILP (optimal)",
                                               placement_kinds={"table_wise": 20, "row_wise": 6},
                                               imbalance_before=0.42, imbalance_after=0.07,
                                               predicted_iteration_ms=15.5)),
        fusion={"method": "milp", "objective": 1370, "launches": 3, "groups": GROUPS},
        rap_schedule=rap_schedule,
    ))


def corun_run(ctx: RunContext, ids: dict | None = None, plan_file: dict | None = None,
              rap_schedule: dict | None = None, train_schedule: dict | None = None,
              events: list[dict] | None = None) -> None:
    """Every system used: auto chose co-run (mapping at 2 workers), DLRover-RM adjusted the plan once, checkpoints
    resumed a retry, warm start from champion v3, the challenger beat v3 on the same day."""
    ids = ids or {}
    data_stages(ctx, ids)
    corun_plan(ctx, ids, plan_file, rap_schedule)
    if events is not None:  # DLRover-RM's events as the stages record them
        out = ctx.read(PlanOutputs)
        (ctx.stage_dir("plan_resources") / "outputs.json").write_text(
            out.model_copy(update={"resource_decisions": events}).model_dump_json())
    write(ctx, TrainOutputs(
        checkpoint_dir="unused", samples_per_s=4800.5, steps=40, wall_s=2.0, world_size=3, samples_trained=[3000],
        job=_job(3), preprocessing="corun", rap_schedule=train_schedule,
        dlrover=DLRoverRun(
            throughput_by_plan=[{"workers": 2, "threads_per_worker": 1, "samples_per_s": 4000.0, "polls": 3},
                                {"workers": 3, "threads_per_worker": 1, "samples_per_s": 5200.0, "polls": 4}],
            final_plan={"workers": 3, "cpu_per_worker": 1.0}, events=5, model_uri="models:/recforge-resources/4",
            executed=[ExecutedDecision(stage="runtime", action="add_worker", reason="throughput below the model")],
            decisions=[ExecutedDecision(stage="runtime", action="add_worker", reason="throughput below the model"),
                       ExecutedDecision(stage="instability", action="replace_straggler", reason="rank 1 slow",
                                        executed=False)],
            plans=[PlanMeasurement(workers=2, threads_per_worker=1, predicted_samples_per_s=4400.0,
                                   measured_samples_per_s=4000.0, polls=3),
                   PlanMeasurement(workers=3, threads_per_worker=1, predicted_samples_per_s=5500.0,
                                   measured_samples_per_s=5200.0, polls=4)],
            memory=MemoryMeasurement(predicted_peak_bytes=1.5 * GiB, measured_peak_bytes=[1.25 * GiB, 1.0 * GiB],
                                     predicted_by="fitted on 3 earlier runs", fitted={"a": 1.0})),
        executor=ExecutorRecord(requested="fused", path="cpp_per_group", native_kernels=True,
                                detail={"groups_run": 3}),
        checkpoints=CheckpointRecord(every_steps=10, flash=True, taken=3, overhead_s=0.05, overhead_fraction=0.025,
                                     resumed_from_step=20, resumes=1, restarts=1, rows_retrained=512),
        warm_start=WarmStartRecord(requested="auto", used=True, champion_version="3",
                                   reason="scheduled run; champion v3 has the same schema and plan"),
    ), ids.get("train"))
    write(ctx, EvaluateOutputs(auc=0.72, logloss=0.55, ne=0.97, rows=3000, auc_ceiling=0.78,
                               champion=ChampionScore(version="3", auc=0.70, logloss=0.56, rows=3000)),
          ids.get("evaluate"))
    write(ctx, CompileOutputs(artifact="inference.pt2", compiled_version="2", report={
        "backend": "inductor", "num_columns": 26, "num_tables": 26, "ops_eager": 78, "ops_compiled": 9,
        "max_abs_diff": 1.5e-7, "atol": 1e-5, "within_tolerance": True, "eager_median_ms": 1.0,
        "compiled_median_ms": 0.25, "speedup": 4.0}), ids.get("compile"))
    write(ctx, PublishOutputs(model_name="recforge-dlrm", version="4", promoted=True,
                              reason="challenger 0.7200 >= champion 0.7000 - margin 0.005 on the same day",
                              challenger_auc=0.72, champion_auc=0.70, pipeline_run_id=ids.get("pipeline", "p")),
          ids.get("publish"))


def inline_run(ctx: RunContext, ids: dict | None = None) -> None:
    """Nothing optional used: auto chose inline, static policy, checkpoints off, from scratch, first champion."""
    ids = ids or {}
    data_stages(ctx, ids)
    w = StageWriter(ctx, "plan_resources")
    (w.tmp / "preprocess_plan.json").write_text(json.dumps({"name": "plan0", "features": []}))
    w.commit(PlanOutputs(
        plan_path=str(w.final / "preprocess_plan.json"), workers=1, threads_per_worker=2, tables=[("C1", 5000)],
        num_dense=13, preprocess_executor="eager", mlflow_run_id=ids.get("plan_resources"),
        preprocessing=PreprocessingChoice(requested="auto", mode="inline",
                                          reason="inline 9.0 ms <= co-run 11.0 ms: nothing to hide behind",
                                          predicted_inline_ms=9.0, predicted_corun_ms=11.0)))
    write(ctx, TrainOutputs(
        checkpoint_dir="unused", samples_per_s=3000.0, steps=10, wall_s=0.1, world_size=1, samples_trained=[3000],
        job=_job(1), preprocessing="inline",
        executor=ExecutorRecord(requested="eager", path="eager", native_kernels=False),
        checkpoints=CheckpointRecord(every_steps=0, flash=False, taken=0, overhead_s=0.0),
        warm_start=WarmStartRecord(requested="scratch", used=False, reason="warm_start is 'scratch'"),
    ), ids.get("train"))
    write(ctx, EvaluateOutputs(auc=0.66, logloss=0.6, ne=0.99, rows=3000), ids.get("evaluate"))
    write(ctx, CompileOutputs(artifact="inference.pt2", report={
        "backend": "inductor", "max_abs_diff": 2e-3, "atol": 1e-5, "within_tolerance": False}), ids.get("compile"))
    write(ctx, PublishOutputs(model_name="recforge-dlrm", version="1", promoted=True,
                              reason="no champion yet; AUC 0.66 above the floor 0.55", challenger_auc=0.66,
                              pipeline_run_id=ids.get("pipeline", "p")), ids.get("publish"))


def stopped_at_train(ctx: RunContext, ids: dict | None = None) -> None:
    """generate, ingest and plan_resources done; train without outputs (failed, or still running)."""
    data_stages(ctx, ids)
    corun_plan(ctx, ids)
