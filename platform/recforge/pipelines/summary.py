"""What a pipeline run decided, did and measured, per system (RAP, DLRover-RM, RECom, checkpoints, executor, warm
start, champion gate), read from the stages' recorded outputs and the run's MLflow runs.

`summarize(ctx)` is what `make demo` and `recforge summary` print; the RecForge page builds the same sections
(`system_sections`) from the same facts. A section for a system the run did not use says so in words (`note`).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from recforge.pipelines.context import RunContext
from recforge.pipelines.outputs import (
    STAGE_OUTPUTS,
    CompileOutputs,
    EvaluateOutputs,
    GenerateOutputs,
    IngestOutputs,
    OutputsError,
    OutputsT,
    PlanOutputs,
    PublishOutputs,
    StageOutputs,
    TrainOutputs,
)

STAGES = list(STAGE_OUTPUTS)  # the pipeline's stages in order
PIPELINE = "pipeline"  # the parent MLflow run's key in RunFacts.runs (recforge.tracking.store.PARENT_STAGE)
# = recforge.tracking.store's tags (not imported: mlflow stays off the CLI's import path); tests check they match
ERROR_TAG = "recforge.error"  # why a FAILED run failed
FAILED_STAGE_TAG = "recforge.failed_stage"  # on the parent run: the stage whose failure failed it
FAILED_STATUSES = ("FAILED", "KILLED")
# what the training loop logs per step (recforge.train.loop.step_loop) and the co-run summary (hooks.rap_training)
CURVE_METRICS = ("train_loss", "train_auc")
RAP_MEASURED = "rap_measured_iteration_ms"


def fmt(value: Any) -> str:
    """A value as the summary and the page print it: '–' for None, thousands separators, a few digits."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value.is_integer() and abs(value) >= 1000:
            return f"{int(value):,}"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e7):
            return f"{value:.3e}"
        return f"{value:,.4f}".rstrip("0").rstrip(".") if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)


@dataclass
class StageRun:
    """What the summary needs of one MLflow run of the pipeline (a stage's, or the parent's)."""

    status: str  # RUNNING | SCHEDULED | FINISHED | FAILED | KILLED
    error: str | None = None  # the ERROR_TAG of a failed run
    failed_stage: str | None = None  # the parent's FAILED_STAGE_TAG: the stage whose failure failed the pipeline


@dataclass
class RunFacts:
    """Everything a summary is built from; every part but the run key may be empty (a run in progress, no MLflow)."""

    run_key: str
    outputs: dict[str, StageOutputs] = field(default_factory=dict)  # stage -> its validated outputs
    unreadable: dict[str, str] = field(default_factory=dict)  # stage -> why its outputs.json is not its model
    runs: dict[str, StageRun] = field(default_factory=dict)  # stage (and PIPELINE) -> its MLflow run
    params: dict[str, str] = field(default_factory=dict)  # the parent run's params (the flattened config)
    train_metrics: dict[str, float] = field(default_factory=dict)  # latest value of each train-run metric
    events: list[dict[str, Any]] = field(default_factory=list)  # DLRover-RM events (Event.to_dict), both stages

    def get(self, model: type[OutputsT]) -> OutputsT | None:
        out = self.outputs.get(model.stage)
        return out if isinstance(out, model) else None


@dataclass
class Section:
    """One system: what it decided, did and measured ((label, value) rows), or in words why there is nothing."""

    key: str
    title: str
    used: bool | None  # True: it ran; False: not used in this run; None: not known yet (stage not done)
    note: str | None = None
    decided: list[tuple[str, Any]] = field(default_factory=list)
    did: list[tuple[str, Any]] = field(default_factory=list)
    measured: list[tuple[str, Any]] = field(default_factory=list)

    state: str = ""  # used | not used | not yet (the run goes on) | not run (the run failed first); system_sections

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def stage_run(status: str, tags: dict[str, str]) -> StageRun:
    return StageRun(status, tags.get(ERROR_TAG), tags.get(FAILED_STAGE_TAG))


# --- status --------------------------------------------------------------------------------------------------------
def run_status(facts: RunFacts) -> dict[str, Any]:
    """{"state": complete | failed | running | incomplete, "stage", "error", "text"} of a run.

    A stage whose outputs are not there is failed when its MLflow run is FAILED/KILLED (the error from its
    ERROR_TAG, else the parent's), running when its MLflow run is RUNNING; a run with no failed stage whose parent
    run is still open is running (between tasks); without MLflow the state is "incomplete"."""
    done = [s for s in STAGES if s in facts.outputs]
    pending = [s for s in STAGES if s not in facts.outputs]
    if not pending:
        return {"state": "complete", "stage": None, "error": None, "text": "complete"}
    parent = facts.runs.get(PIPELINE)
    for stage in pending:
        run = facts.runs.get(stage)
        if run is not None and run.status == "RUNNING":
            text = f"running: {stage}"
            if run.error:  # a retry of a failed attempt
                text += f" (an earlier attempt failed: {run.error})"
            return {"state": "running", "stage": stage, "error": None, "text": text}
    for stage in pending:
        run = facts.runs.get(stage)
        if run is not None and run.status in FAILED_STATUSES:
            error = run.error or (parent.error if parent else None) or "no reason recorded"
            return {"state": "failed", "stage": stage, "error": error, "text": f"failed at {stage}: {error}"}
    nxt = pending[0]
    if nxt in facts.unreadable:
        return {"state": "failed", "stage": nxt, "error": facts.unreadable[nxt],
                "text": f"failed at {nxt}: its outputs are unreadable"}
    if parent is not None and parent.status in FAILED_STATUSES:
        stage, error = parent.failed_stage or nxt, parent.error or "no reason recorded"
        return {"state": "failed", "stage": stage, "error": error, "text": f"failed at {stage}: {error}"}
    progress = f"{len(done)}/{len(STAGES)} stages"
    if parent is not None and parent.status == "RUNNING":
        return {"state": "running", "stage": nxt, "error": None, "text": f"running: {progress}, next {nxt}"}
    return {"state": "incomplete", "stage": nxt, "error": None, "text": f"{progress} (next: {nxt})"}


# --- the systems ---------------------------------------------------------------------------------------------------
def _ms(value: float | None) -> float | None:
    return round(float(value), 3) if value is not None else None


def _pct(value: float | None) -> str | None:
    return f"{100 * value:.2f} %" if value is not None else None


def _plan_text(plan: Any) -> str | None:
    """A resource plan dict (PodPlan.to_dict / ResourcePlan) as '2 workers x 1 CPU, 0.50 GiB'."""
    if not isinstance(plan, dict):
        return None
    workers = plan.get("workers")
    cpu = plan.get("cpu_per_worker", plan.get("threads_per_worker"))
    text = f"{fmt(workers)} worker(s) x {fmt(cpu)} CPU"
    mem = plan.get("memory_per_worker")
    if isinstance(mem, (int, float)) and mem:
        text += f", {mem / 2**30:.2f} GiB each"
    return text


def measured_step_ms(facts: RunFacts) -> tuple[str, float] | None:
    """The measured training iteration: RAP's co-run measurement where the workers co-ran, else the trainer's
    wall time over its steps."""
    if RAP_MEASURED in facts.train_metrics:
        return "measured iteration, co-run (ms)", facts.train_metrics[RAP_MEASURED]
    train = facts.get(TrainOutputs)
    if train is not None and train.steps > 0:
        return "measured step time, wall time / steps (ms)", 1000.0 * train.wall_s / train.steps
    return None


def rap_section(facts: RunFacts) -> Section:
    s = Section("rap", "RAP: preprocessing (co-run and mapping)", used=None)
    plan, train = facts.get(PlanOutputs), facts.get(TrainOutputs)
    if plan is None:
        s.note = "not planned yet: plan_resources has no outputs"
        return s
    choice, corun = plan.preprocessing, plan.corun
    mode = choice.mode if choice else (train.preprocessing if train and train.preprocessing else
                                       ("corun" if corun else None))
    s.used = mode == "corun"
    if choice is not None:
        requested = choice.requested if choice.requested != choice.mode else None
        s.decided.append(("mode", f"{choice.mode} (requested: {requested})" if requested else choice.mode))
        s.decided.append(("why", choice.reason))
        kind = "lower bound" if choice.bound else "predicted"  # the cheap check: bounds, not a profile's prediction
        s.decided.append((f"{kind} iteration, inline (ms)", _ms(choice.predicted_inline_ms)))
        s.decided.append((f"{kind} iteration, co-run (ms)", _ms(choice.predicted_corun_ms)))
    elif mode is not None:
        s.decided.append(("mode", f"{mode} (no record of why: the plan task predates the choice record)"))
    if train is not None and train.preprocessing and train.preprocessing != mode:
        s.did.append(("the workers ran", train.preprocessing))
    predicted = None
    if corun is not None:
        s.did.append(("co-run schedule", corun.source or "planned by RAP's scheduler"))
        s.did.append(("co-run threads", corun.threads))
        if plan.fusion and plan.fusion.get("launches") is not None:
            s.did.append(("fused kernel launches", plan.fusion.get("launches")))
        if corun.mapping is not None:
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(corun.mapping.placement_kinds.items()))
            s.did.append(("mapping", f"{corun.mapping.placed_by}; tables: {kinds or 'none'}"))
            s.measured.append(("mapping imbalance before", corun.mapping.imbalance_before))
            s.measured.append(("mapping imbalance after", corun.mapping.imbalance_after))
            predicted = corun.mapping.predicted_iteration_ms
        else:
            s.did.append(("mapping", "not used (one worker, or corun.mapping off): each worker preprocessed its own "
                                     "batch"))
        predicted = predicted if predicted is not None else corun.predicted_iteration_ms
    elif choice is not None and not choice.bound:
        predicted = {"inline": choice.predicted_inline_ms}.get(choice.mode)
    if choice is not None and choice.bound and corun is None:
        s.measured.insert(0, ("lower bound of the iteration (ms)", _ms(choice.predicted_inline_ms)))
    else:
        s.measured.insert(0, ("predicted iteration (ms)", _ms(predicted)))
    measured = measured_step_ms(facts)
    if measured is not None:
        s.measured.insert(1, (measured[0], _ms(measured[1])))
    elif train is None:
        s.measured.insert(1, ("measured iteration (ms)", "not trained yet"))
    if not s.used:
        how = ("" if choice is None else ", as auto chose from RAP's predictions" if choice.requested == "auto"
               else f", as configured (preprocessing={choice.requested})")
        s.note = f"co-run not used: the workers preprocessed {mode or 'inline'}{how}"
    return s


def _event_prediction(events: Iterable[dict[str, Any]], stage: str, key: str) -> float | None:
    for e in events:
        pred = e.get("prediction") if e.get("stage") == stage else None
        value = pred.get(key) if isinstance(pred, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def dlrover_section(facts: RunFacts) -> Section:
    s = Section("dlrover", "DLRover-RM: resources", used=None)
    plan, train = facts.get(PlanOutputs), facts.get(TrainOutputs)
    policy = facts.params.get("resources.policy")
    if plan is None:
        s.note = "not planned yet: plan_resources has no outputs"
        return s
    s.used = plan.dlrover is not None or (train is not None and train.dlrover is not None)
    if not s.used:
        why = ("resources.policy=dlrover, but plan_resources recorded no DLRover-RM stage 1" if policy == "dlrover"
               else f"resources.policy={policy}" if policy else "no DLRover-RM stage 1 recorded")
        s.note = (f"not used ({why}): the job ran the configured plan, {plan.workers} worker(s) x "
                  f"{plan.threads_per_worker} thread(s)")
        return s
    state = plan.dlrover or {}
    warm = [e for e in facts.events if e.get("stage") == "warm_start"]
    s.decided.append(("stage 1 plan", _plan_text(state.get("plan")) or
                      f"{plan.workers} worker(s) x {plan.threads_per_worker} thread(s)"))
    if warm:
        s.decided.append(("why", str(warm[-1].get("reason", ""))))
    predicted = _event_prediction(warm, "warm_start", "samples_per_s")
    if train is None:
        s.did.append(("stages 2/3", "not run yet: train has no outputs"))
        s.measured.append(("predicted throughput (samples/s)", predicted))
        return s
    run = train.dlrover
    if run is None:
        s.did.append(("stages 2/3", "off for this run (the train task could not use stage 1's state)"))
        s.measured.append(("predicted throughput (samples/s)", predicted))
        s.measured.append(("job throughput (samples/s)", train.samples_per_s))
        return s
    decisions = run.decisions or run.executed
    s.did.append(("decisions executed", sum(d.executed for d in decisions)))
    for d in decisions:
        s.did.append((f"{d.stage}: {d.action}" + ("" if d.executed else " (not executed)"), d.reason))
    s.did.append(("events logged (executed or not)", run.events))
    s.did.append(("final plan", _plan_text(run.final_plan)))
    if run.model_uri:
        s.did.append(("resource model (history for the next run)", run.model_uri))
    if run.plans:  # stage 1's model against the profiler, per plan the job ran
        for p in run.plans:
            where = f"{p.workers} worker(s) x {p.threads_per_worker} thread(s)"
            s.measured.append((f"{where}: predicted (samples/s)", p.predicted_samples_per_s))
            s.measured.append((f"{where}: measured (samples/s, {p.polls} polls)", p.measured_samples_per_s))
            if p.predicted_samples_per_s and p.measured_samples_per_s > 0:
                s.measured.append((f"{where}: predicted / measured",
                                   round(p.predicted_samples_per_s / p.measured_samples_per_s, 3)))
    else:
        s.measured.append(("predicted throughput (samples/s)", predicted))
        for tp in run.throughput_by_plan:
            s.measured.append((f"measured at {_plan_text(tp)} (samples/s)", tp.get("samples_per_s")))
    if run.memory is not None:
        m = run.memory
        measured_peak = max(m.measured_peak_bytes) if m.measured_peak_bytes else None
        s.measured.append(("peak memory per worker, predicted (GiB)", _gib(m.predicted_peak_bytes)))
        s.measured.append(("peak memory per worker, measured max (GiB)",
                           _gib(measured_peak) if measured_peak is not None else "not reported by the workers"))
        s.measured.append(("memory model used", m.predicted_by))
    s.measured.append(("job throughput (samples/s)", train.samples_per_s))
    # fields the record gains later show as they are
    for key, value in run.model_dump(exclude=set(_DLROVER_SHOWN)).items():
        if value is not None and value != []:
            s.measured.append((key.replace("_", " "), value if not isinstance(value, (dict, list)) else str(value)))
    return s


def _gib(value: float | None) -> float | None:
    return round(value / 2**30, 3) if value is not None else None


_DLROVER_SHOWN = ("throughput_by_plan", "final_plan", "events", "model_uri", "executed", "decisions", "plans",
                  "memory")


def recom_section(facts: RunFacts) -> Section:
    s = Section("recom", "RECom: compiled inference", used=None)
    comp = facts.get(CompileOutputs)
    if comp is None:
        s.note = "not compiled yet: compile has no outputs"
        return s
    r = comp.report
    s.used = True
    s.decided.append(("backend", r.backend))
    s.did.append(("embedding columns", r.num_columns))
    s.did.append(("embedding tables", r.num_tables))
    if r.ops_eager is not None or r.ops_compiled is not None:
        s.did.append(("ops, eager -> compiled", f"{fmt(r.ops_eager)} -> {fmt(r.ops_compiled)}"))
    if r.lookups_eager is not None or r.lookups_compiled is not None:
        s.did.append(("lookups, eager -> compiled", f"{fmt(r.lookups_eager)} -> {fmt(r.lookups_compiled)}"))
    s.did.append(("registered", f"version {comp.compiled_version}" if comp.compiled_version else
                  "not registered (the compiled model did not match eager)"))
    s.measured.append(("eager latency (median ms)", r.eager_median_ms))
    s.measured.append(("compiled latency (median ms)", r.compiled_median_ms))
    s.measured.append(("speedup vs eager", f"{r.speedup:.2f}x" if r.speedup is not None else None))
    s.measured.append(("max |compiled - eager|", r.max_abs_diff))
    s.measured.append(("within tolerance", f"{fmt(r.within_tolerance)} (atol {fmt(r.atol)})"))
    return s


def checkpoint_section(facts: RunFacts) -> Section:
    s = Section("checkpoints", "Checkpoints", used=None)
    train = facts.get(TrainOutputs)
    if train is None:
        s.note = "not trained yet: train has no outputs"
        return s
    c = train.checkpoints
    if c is None:
        s.used = False
        s.note = "no checkpoint record: this run's train task did not record its checkpoints"
        return s
    s.used = c.every_steps > 0 or c.flash
    s.decided.append(("every", f"{c.every_steps} steps" if c.every_steps else "final checkpoint only"))
    s.decided.append(("flash checkpoints", c.flash))
    s.did.append(("checkpoints taken", c.taken))
    s.did.append(("train task attempts resumed", c.resumes))
    if c.resumed_from_step is not None:
        s.did.append(("resumed from step", c.resumed_from_step))
    s.did.append(("worker-group restarts", c.restarts))
    s.measured.append(("time blocked on saves (s)", round(c.overhead_s, 3)))
    s.measured.append(("overhead (share of training time)", _pct(c.overhead_fraction)))
    s.measured.append(("rows retrained after failures", c.rows_retrained))
    if not s.used:
        s.note = ("checkpoints off (checkpoint.every_steps=0, no flash): only the final model was saved; a retry "
                  "trains from scratch")
    return s


def executor_section(facts: RunFacts) -> Section:
    s = Section("executor", "Preprocessing executor", used=None)
    train, plan = facts.get(TrainOutputs), facts.get(PlanOutputs)
    if train is None:
        s.note = "not trained yet: train has no outputs"
        if plan is not None:
            s.decided.append(("configured", plan.preprocess_executor))
        return s
    e = train.executor
    if e is None:
        s.used = False
        s.note = (f"no record of the path that ran (configured: "
                  f"{plan.preprocess_executor if plan else 'unknown'})")
        return s
    s.used = True
    s.decided.append(("configured", e.requested))
    s.did.append(("path that ran", e.path))
    s.did.append(("C++ kernels loaded and ran", e.native_kernels))
    for key, value in e.detail.items():
        s.did.append((key.replace("_", " "), value if not isinstance(value, (dict, list)) else str(value)))
    return s


def warm_start_section(facts: RunFacts) -> Section:
    s = Section("warm_start", "Warm start (continuous training)", used=None)
    train = facts.get(TrainOutputs)
    if train is None:
        s.note = "not trained yet: train has no outputs"
        return s
    w = train.warm_start
    if w is None:
        s.used = False
        s.note = "no warm-start record: trained from scratch"
        return s
    s.used = w.used
    s.decided.append(("requested", w.requested))
    s.decided.append(("why", w.reason))
    s.did.append(("started from", f"champion version {w.champion_version}" if w.used else "scratch"))
    if not w.used:
        s.note = f"trained from scratch: {w.reason}"
    return s


def gate_section(facts: RunFacts) -> Section:
    s = Section("gate", "Champion gate", used=None)
    ev, pub = facts.get(EvaluateOutputs), facts.get(PublishOutputs)
    if ev is None and pub is None:
        s.note = "not evaluated yet: evaluate has no outputs"
        return s
    challenger = pub.challenger_auc if pub is not None and pub.challenger_auc is not None else (ev.auc if ev else None)
    champion = ev.champion if ev is not None else None
    champion_auc = pub.champion_auc if pub is not None and pub.champion_auc is not None else (
        champion.auc if champion else None)
    s.measured.append(("challenger AUC", challenger))
    if champion is not None or champion_auc is not None:
        version = f" (version {champion.version})" if champion is not None else ""
        s.measured.append((f"champion AUC, same held-out day{version}", champion_auc))
        if challenger is not None and champion_auc is not None:
            s.measured.append(("challenger - champion", round(challenger - champion_auc, 6)))
    else:
        s.measured.append(("champion AUC", "no champion yet"))
    if ev is not None:
        s.measured.append(("held-out rows evaluated", ev.rows))
    if pub is None:
        s.note = "no decision yet: publish has no outputs"
        return s
    s.used = True
    s.decided.append(("promoted to champion", pub.promoted))
    s.decided.append(("why", pub.reason))
    s.did.append(("registered model", f"{pub.model_name} v{pub.version}"))
    return s


SECTIONS = (rap_section, dlrover_section, recom_section, checkpoint_section, executor_section, warm_start_section,
            gate_section)


def system_sections(facts: RunFacts, status: dict[str, Any] | None = None) -> list[Section]:
    """Every system's section; where a system has nothing yet, a failed run says that it will not run."""
    status = status or run_status(facts)
    sections = [build(facts) for build in SECTIONS]
    for sec in sections:
        if sec.used is not None:
            sec.state = "used" if sec.used else "not used"
        elif status["state"] == "failed":
            sec.state = "not run"
            sec.note = f"not run: the run failed at {status['stage']} ({sec.note})"
        else:
            sec.state = "not yet"
    return sections


def results(facts: RunFacts) -> dict[str, Any]:
    """The run's headline numbers, where recorded."""
    gen, ing, tr = facts.get(GenerateOutputs), facts.get(IngestOutputs), facts.get(TrainOutputs)
    ev, comp, pub = facts.get(EvaluateOutputs), facts.get(CompileOutputs), facts.get(PublishOutputs)
    out: dict[str, Any] = {}
    if ing is not None:
        out |= {"rows_ingested": ing.rows_ingested, "rows_quarantined": ing.rows_quarantined}
        if ing.stats is not None:  # drift against the previous day: reported, never a failure
            out["drift_flags"] = len(ing.stats.flags)
            if ing.stats.drifted_columns:
                out["drifted_columns"] = ", ".join(ing.stats.drifted_columns)
    if tr is not None:
        out |= {"train_samples_per_s": tr.samples_per_s, "train_world_size": tr.world_size, "train_steps": tr.steps,
                "train_wall_s": tr.wall_s}
        if "final_train_loss" in facts.train_metrics:
            out["final_train_loss"] = facts.train_metrics["final_train_loss"]
    if ev is not None:
        out |= {"holdout_auc": ev.auc, "holdout_logloss": ev.logloss, "holdout_ne": ev.ne}
    ceiling = ev.auc_ceiling if ev is not None else None
    if ceiling is None and gen is not None and gen.bayes_auc:
        ceiling = gen.bayes_auc[-1]
    if ceiling is not None:
        out["auc_ceiling"] = ceiling
    if comp is not None:
        out |= {"compile_backend": comp.report.backend, "compile_speedup": comp.report.speedup}
    if pub is not None:
        out |= {"model": f"{pub.model_name} v{pub.version}", "champion": pub.promoted,
                "pipeline_run_id": pub.pipeline_run_id}
    return out


def summary_of(facts: RunFacts) -> dict[str, Any]:
    """{"run_key", "status" (run_status), "results" (headline numbers), "systems" (key -> Section dict),
    "problems"} : JSON-able."""
    status = run_status(facts)
    return {
        "run_key": facts.run_key,
        "status": status,
        "results": results(facts),
        "systems": {s.key: s.to_dict() for s in system_sections(facts, status)},
        "problems": [f"{stage}: {why}" for stage, why in facts.unreadable.items()],
    }


# --- reading a run -------------------------------------------------------------------------------------------------
def read_outputs(ctx: RunContext) -> tuple[dict[str, StageOutputs], dict[str, str]]:
    """Every stage's outputs that exist and validate; the others' reasons (a missing stage is neither)."""
    outputs, unreadable = {}, {}
    for stage, model in STAGE_OUTPUTS.items():
        try:
            outputs[stage] = ctx.read(model)
        except FileNotFoundError:
            continue
        except (OutputsError, OSError, UnicodeDecodeError) as e:
            unreadable[stage] = str(e)
    return outputs, unreadable


class MlflowReader(Protocol):
    """What the summary reads from MLflow (recforge.ui.mlflow_view.MlflowView is one; passed in by the caller, so
    pipelines does not import the UI): each stage's run of a run key, a stage run's DLRover-RM events, and what
    could not be read."""

    problems: list[str]

    def stage_runs(self, run_key: str) -> dict[str, Any]: ...  # stage (and "pipeline") -> run: status, tags, ...

    def events(self, run: Any) -> list[dict[str, Any]]: ...


def facts_of(ctx: RunContext, ml: MlflowReader | None = None) -> tuple[RunFacts, list[str]]:
    """The run's facts from its directory and (best effort) its MLflow runs through `ml` (None: the recorded
    outputs only). Returns the facts and what could not be read from MLflow."""
    outputs, unreadable = read_outputs(ctx)
    facts = RunFacts(ctx.run_key, outputs, unreadable)
    if ml is None:
        return facts, []
    mlruns = ml.stage_runs(ctx.run_key)
    facts.runs = {stage: stage_run(r.status, r.tags) for stage, r in mlruns.items()}
    if PIPELINE in mlruns:
        facts.params = dict(mlruns[PIPELINE].params)
    if "train" in mlruns:
        facts.train_metrics = dict(mlruns["train"].metrics)
    facts.events = recorded_events(facts, lambda stage: ml.events(mlruns[stage]) if stage in mlruns else [])
    return facts, list(ml.problems)


def recorded_events(facts: RunFacts, from_mlflow: Any) -> list[dict[str, Any]]:
    """DLRover-RM's events of plan_resources then train: as the stage recorded them in its outputs, else from its
    MLflow run (`from_mlflow(stage)`)."""
    events: list[dict[str, Any]] = []
    plan, train = facts.get(PlanOutputs), facts.get(TrainOutputs)
    for stage, recorded in (("plan_resources", plan.resource_decisions if plan else None),
                            ("train", train.resource_decisions if train else None)):
        events += recorded if recorded is not None else from_mlflow(stage)
    return events


def summarize(ctx: RunContext, ml: MlflowReader | None = None) -> dict[str, Any]:
    """The run's summary (summary_of) from its recorded outputs and, through `ml`, its MLflow runs (the CLI and
    the demo pass recforge.ui.mlflow_view.MlflowView); what could not be read from MLflow is under "problems"."""
    facts, problems = facts_of(ctx, ml)
    summary = summary_of(facts)
    summary["problems"] += problems
    return summary
