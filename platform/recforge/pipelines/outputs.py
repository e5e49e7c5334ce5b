"""What each pipeline stage records in `<run>/<stage>/outputs.json`, one pydantic model per stage.

A stage returns its model; `StageWriter.commit` writes it and `RunContext.read(Model)` reads it back, validated,
so later stages, the CLI and the UI use attributes rather than string keys. Pure pydantic: imported by the UI and
the DAG-parse path, so nothing heavy here.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Record(BaseModel):
    """Base of the records below: unknown fields are errors; NaN / Infinity are written as json.dumps writes them."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class StageOutputs(Record):
    """Base of every stage's outputs: `stage` names the directory, `mlflow_run_id` is filled in by run_stage."""

    stage: ClassVar[str]

    mlflow_run_id: str | None = Field(None, description="the stage's MLflow child run")


# --- generate / ingest ------------------------------------------------------------------------------------------
class GenerateOutputs(StageOutputs):
    stage: ClassVar[str] = "generate"

    files: list[str] = Field(description="raw day files (local paths): the training days, then the held-out day's")
    synthetic: bool = Field(description="generated here (True) or read from the landing zone, source_uri (False)")
    bayes_auc: list[float] | None = Field(None, description="synthetic days: Bayes-optimal AUC per day file")
    positive_rate: list[float] | None = Field(None, description="synthetic days: share of positive labels per day file")
    run_day: str | None = Field(None, description="the run's day (YYYY-MM-DD, its logical date); None outside Airflow")
    days: list[str] | None = Field(None, description="the day (YYYY-MM-DD) of each file; None: one file per day")
    sources: list[str] | None = Field(None, description="landing zone: the URL each file was read from")
    holdout: Literal["next_day", "split"] = Field(
        "next_day", description="next_day: the last day's files are held out; split: the run day's last rows are")


class SplitOutputs(Record):
    """One ingested split: its Parquet shards and what validation kept."""

    manifest_dir: str = Field(description="directory holding the split's manifest.json")
    rows: int = Field(ge=0, description="rows kept")
    quarantined: int = Field(ge=0, description="rows rejected by validation")
    shards: int = Field(ge=0)


class ColumnSummary(Record):
    """One column's statistics for the page (recforge.data.stats.ColumnStats, the fields the table shows)."""

    name: str
    role: str
    missing_rate: float
    distinct: int
    distinct_exact: bool = True
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    positive_rate: float | None = None
    mean_length: float | None = None


class DriftFlagRecord(Record):
    """A drift flag as recorded (the fields of recforge.data.drift.DriftFlag)."""

    column: str | None
    kind: str
    previous: float | str | None = None
    current: float | str | None = None
    threshold: float | None = None
    message: str


class DataStatsOutputs(Record):
    """Column statistics of an ingested split and its drift against the previous day
    (recforge.pipelines.hooks.data_stats.record_data_stats)."""

    split: str
    day: str | None = Field(None, description="the data day the statistics are keyed by (None: an undated run)")
    rows: int = Field(ge=0)
    stats_path: str = Field(description="stats.json beside the split's manifest")
    drift_path: str = Field(description="drift.json beside the split's manifest: the flags and what was compared")
    plot_path: str | None = Field(None, description="missing rate per column, this day vs the previous one (PNG)")
    previous_day: str | None = Field(None, description="the day compared against (None: no earlier day recorded)")
    previous_stats: str | None = Field(None, description="the earlier day's stats file compared against")
    columns: list[ColumnSummary]
    flags: list[DriftFlagRecord] = Field(default_factory=list)
    drifted_columns: list[str] = Field(default_factory=list)


class IngestOutputs(StageOutputs):
    stage: ClassVar[str] = "ingest"

    train: SplitOutputs = Field(description="the training days (holdout split: less the run day's last rows)")
    holdout: SplitOutputs = Field(description="the held-out rows (holdout setting), for evaluate and compile")
    rows_ingested: int = Field(ge=0)
    rows_quarantined: int = Field(ge=0)
    stats: DataStatsOutputs | None = Field(None, description="column statistics and drift of the training split")


# --- plan_resources ---------------------------------------------------------------------------------------------
class ProfileSummary(Record):
    """The RAP stage profile the schedule was planned on (recforge.rap.profiling.profile_job.summary)."""

    key: str
    origin: str = Field(description="where the profile came from (stored or measured now)")
    threshold: float
    stage_ms: dict[str, float]
    capacity_ms: dict[str, float]
    seconds: float | None = Field(None, description="time spent profiling, when measured now")


class MappingSummary(Record):
    """RAP's mapping as planned (recforge.pipelines.hooks.rap_planning.plan_mapped_schedules, less the file)."""

    placed_by: str
    placement_kinds: dict[str, int] = Field(description="tables per sharding kind")
    imbalance_before: float | None = None
    imbalance_after: float | None = None
    predicted_iteration_ms: float | None = None


class CorunPlan(Record):
    """preprocessing == "corun": the co-run schedule (and mapping) every worker runs."""

    schedule_path: str
    source: str | None = Field(None, description="what the schedule was planned from")
    predicted_iteration_ms: float | None = None
    threads: int = Field(ge=1, description="intra-op threads of the co-run thread")
    profile: ProfileSummary | None = None
    mapping_path: str | None = Field(None, description="RAP mapping file (corun.mapping with 2+ workers)")
    mapping: MappingSummary | None = None


class PreprocessingChoice(Record):
    """Which preprocessing mode the run uses and why (config `preprocessing`; 'auto' decides by RAP's prediction)."""

    requested: str = Field(description="as configured: auto | inline | corun | offline")
    mode: str = Field(description="what the workers run: inline | corun | offline")
    reason: str = Field(description="why this mode (auto: the two predictions compared; else: configured)")
    predicted_inline_ms: float | None = Field(None, description="predicted iteration time, preprocessing inline")
    predicted_corun_ms: float | None = Field(None, description="predicted iteration time, RAP co-run")
    bound: bool = Field(False, description="auto decided before profiling: both predictions are lower bounds "
                        "(a training step on one rank; + preprocessing for inline)")


class PlanOutputs(StageOutputs):
    stage: ClassVar[str] = "plan_resources"

    plan_path: str = Field(description="the preprocessing Plan (JSON) every worker runs")
    workers: int = Field(ge=1)
    threads_per_worker: int = Field(ge=1)
    tables: list[tuple[str, int]] = Field(description="embedding tables as (name, rows)")
    num_dense: int = Field(ge=0)
    preprocess_executor: str
    dlrover: dict[str, Any] | None = Field(
        None, description="policy 'dlrover': stage 1's state for the train task (DLRoverPolicy.stage1_state)")
    preprocessing: PreprocessingChoice | None = Field(None, description="the mode the workers run, and why")
    corun: CorunPlan | None = None
    # sections of the run page (plugins/README.md)
    rap_schedule: dict[str, Any] | None = Field(None, description="Gantt: {unit, tasks: [{name, lane, start, end}]}")
    fusion: dict[str, Any] | None = Field(None, description="RAP's CompiledPlan.summary()")
    resource_decisions: list[dict[str, Any]] | None = Field(None, description="resource events (Event.to_dict)")


# --- train / evaluate -------------------------------------------------------------------------------------------
class PlanRecord(Record):
    """A resource plan as the job ran it (recforge.elastic.policy.ResourcePlan)."""

    model_config = ConfigDict(from_attributes=True)

    workers: int = Field(ge=1)
    threads_per_worker: int = Field(ge=1)


class JobRecord(Record):
    """What run_training_job returned (recforge.elastic.job.JobResult); `JobRecord.model_validate(result)`."""

    model_config = ConfigDict(from_attributes=True)

    exit_code: int
    plan: PlanRecord
    finished: bool = Field(description="the master handed out and got back every row of every epoch")
    tasks_done: int
    samples: int
    per_worker: dict[str, dict[str, Any]] = Field(description="the master's statistics per worker")
    poisoned: list[dict[str, Any]]
    master_state: dict[str, Any]
    spec_path: Path | None = None
    state_file: Path | None = None
    log_path: Path | None = None
    attempts: list[dict[str, Any]] = Field(default_factory=list, description="one per launch")
    restarts: int = 0
    grad_accumulation: int = 1


class ExecutedDecision(Record):
    stage: str
    action: str
    reason: str
    executed: bool = Field(True, description="carried out (a relaunch at the new plan) or not (the reason says why)")


class PlanMeasurement(Record):
    """One plan the job ran: stage 1's prediction against what the job master measured."""

    workers: int
    threads_per_worker: int
    predicted_samples_per_s: float | None = Field(description="by the model stage 1 planned with (None: no model)")
    measured_samples_per_s: float = Field(description="median over the profiler's polls at this plan")
    polls: int


class MemoryMeasurement(Record):
    """Per-worker peak memory of the final plan: predicted by stage 1's memory model, measured in the workers."""

    predicted_peak_bytes: float | None = Field(description="largest worker's predicted peak (None: no table sizes)")
    measured_peak_bytes: list[float] = Field(description="peak RSS of each rank (empty: the workers reported none)")
    predicted_by: str = Field(description="the memory model stage 1 used and why")
    fitted: dict[str, Any] = Field(description="the memory model this run fitted and stored (MemoryModel.to_dict)")


class DLRoverRun(Record):
    """policy 'dlrover': what stages 2/3 decided and executed during training (pipelines.train_dlrover.finish)."""

    throughput_by_plan: list[dict[str, Any]] = Field(description="samples/s measured at each plan, in order")
    final_plan: dict[str, Any]
    events: int = Field(description="events logged (executed or not)")
    model_uri: str | None = Field(None, description="the run's resource model, history for the next stage 1")
    executed: list[ExecutedDecision]
    decisions: list[ExecutedDecision] = Field(default_factory=list, description="every decision, executed or not")
    plans: list[PlanMeasurement] = Field(default_factory=list, description="predicted vs measured throughput")
    memory: MemoryMeasurement | None = Field(None, description="predicted vs measured peak memory per worker")


class ExecutorRecord(Record):
    """The preprocessing executor path that actually executed in the workers (not the one configured)."""

    requested: str = Field(description="as configured: eager | fused | dali")
    path: str = Field(description="what ran, e.g. cpp_single_pass | cpp_per_group | torch_fallback | eager | dali")
    native_kernels: bool = Field(description="the C++ kernels (recforge_kernels) loaded and ran")
    detail: dict[str, Any] = Field(default_factory=dict, description="per-group paths, DALI's fallbacks, ...")


class CheckpointRecord(Record):
    """Checkpoints of the training job: cadence, cost, and what was resumed from them."""

    every_steps: int = Field(ge=0)
    flash: bool
    taken: int = Field(ge=0, description="step checkpoints taken (final one not counted)")
    overhead_s: float = Field(ge=0, description="training time spent blocked on checkpoint saves")
    overhead_fraction: float | None = Field(None, description="overhead_s / training wall time")
    resumed_from_step: int | None = Field(None, description="the step a resumed attempt started from")
    resumes: int = Field(0, ge=0, description="attempts of the train task that resumed from a checkpoint")
    restarts: int = Field(0, ge=0, description="worker-group relaunches inside the job")
    rows_retrained: int = Field(0, ge=0, description="rows trained again after a failure (work lost)")


class WarmStartRecord(Record):
    """Continuous training: whether the run started from the champion's weights, and why (not)."""

    requested: str = Field(description="as configured: auto | champion | scratch")
    used: bool
    champion_version: str | None = None
    reason: str
    checkpoint: str | None = Field(None, description="the champion's final checkpoint the workers loaded")


class TrainOutputs(StageOutputs):
    stage: ClassVar[str] = "train"

    checkpoint_dir: str
    samples_per_s: float
    steps: int
    wall_s: float
    world_size: int
    samples_trained: list[int] = Field(description="samples per epoch")
    job: JobRecord
    dlrover: DLRoverRun | None = None
    preprocessing: str | None = Field(None, description="the preprocessing mode the workers ran")
    executor: ExecutorRecord | None = None
    checkpoints: CheckpointRecord | None = None
    warm_start: WarmStartRecord | None = None
    # sections of the run page (plugins/README.md)
    rap_schedule: dict[str, Any] | None = Field(None, description="Gantt: {unit, tasks: [{name, lane, start, end}]}")
    resource_decisions: list[dict[str, Any]] | None = Field(None, description="resource events (Event.to_dict)")


class ChampionScore(Record):
    """The current champion scored on the same held-out day as the challenger."""

    version: str
    auc: float
    logloss: float
    rows: int = Field(ge=0)


class EvaluateOutputs(StageOutputs):
    stage: ClassVar[str] = "evaluate"

    auc: float
    logloss: float
    ne: float = Field(description="normalized entropy")
    rows: int = Field(ge=0, description="held-out rows evaluated")
    auc_ceiling: float | None = Field(None, description="synthetic data: the held-out day's Bayes AUC")
    champion: ChampionScore | None = Field(None, description="the champion on the same day (None: no champion yet, "
                                           "or it could not be scored: champion_problem)")
    champion_version: str | None = Field(None, description="the champion when evaluate ran (scored or not)")
    champion_problem: str | None = Field(None, description="why the champion could not be scored on this day")


# --- compile / publish ------------------------------------------------------------------------------------------
class LatencyReport(Record):
    batch_size: int
    threads: int
    eager: dict[str, Any] = Field(description="recforge.recom.report.measure_latency")
    compiled: dict[str, Any]


class CompileReport(Record):
    """recforge.recom.report.compile_report. Extra fields are kept: RECom adds fields and the page lists them."""

    model_config = ConfigDict(extra="allow")

    backend: str
    num_columns: int | None = None
    num_tables: int | None = None
    ops_eager: int | None = None
    ops_compiled: int | None = None
    graph_nodes: int | None = None
    lookups_eager: int | None = None
    lookups_compiled: int | None = None
    heldout_rows: int | None = None
    max_abs_diff: float
    atol: float
    within_tolerance: bool
    latency: LatencyReport | None = None
    eager_median_ms: float | None = None
    compiled_median_ms: float | None = None
    speedup: float | None = None

    @property
    def extras(self) -> dict[str, Any]:
        """Fields this model does not declare (a later report's), in order."""
        return dict(self.model_extra or {})


class CompileOutputs(StageOutputs):
    stage: ClassVar[str] = "compile"

    artifact: str = Field(description="the compiled inference.pt2")
    report: CompileReport
    compiled_version: str | None = Field(None, description="registered <model>-compiled version (None: not registered, "
                                                           "the compiled model did not match eager)")


class PublishOutputs(StageOutputs):
    stage: ClassVar[str] = "publish"

    model_name: str
    version: str
    promoted: bool = Field(description="became the champion")
    reason: str = Field(description="why it was (not) promoted")
    challenger_auc: float | None = None
    champion_auc: float | None = Field(None, description="the champion's AUC on the same held-out day")
    champion_version: str | None = Field(None, description="the champion it was compared with")
    pipeline_run_id: str = Field(description="the run's parent MLflow run")


STAGE_OUTPUTS: dict[str, type[StageOutputs]] = {
    m.stage: m for m in (GenerateOutputs, IngestOutputs, PlanOutputs, TrainOutputs, EvaluateOutputs, CompileOutputs,
                         PublishOutputs)
}


class OutputsError(ValueError):
    """A stage's outputs.json does not hold its model; the message names the fields."""


def problems(e: ValidationError) -> str:
    """'field.path: message' for every error, '; '-joined."""
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in e.errors())


OutputsT = TypeVar("OutputsT", bound=StageOutputs)


def parse_outputs(model: type[OutputsT], data: str | bytes | dict[str, Any], where: str) -> OutputsT:
    """`data` (JSON text or parsed) as `model`, or OutputsError naming `where` and the bad fields."""
    try:
        if isinstance(data, dict):
            return model.model_validate(data)
        return model.model_validate_json(data)
    except ValidationError as e:
        raise OutputsError(f"{where} does not hold {model.__name__}: {problems(e)}") from None
