"""Turn a run's recorded outputs and its MLflow runs into the page's sections; a section exists only where its
data does. Pure data (strings, numbers, lists): the templates render it with escaping on.

Each stage's outputs are read as its model (recforge.pipelines.outputs); a file that does not validate is listed
under the problems with the fields, and still shows raw under "recorded outputs". The per-system sections (what RAP,
DLRover-RM, RECom, checkpoints, the executor, warm start and the champion gate decided, did and measured) and the
run's status (failed with its error, running, complete) are recforge.pipelines.summary's, as `recforge summary`
prints them. Charts: the RAP Gantt (plan_resources/train `rap_schedule`, else the co-run schedule file over the
profiled stages), fused groups (plan_resources `fusion`, else the schedule's groups), the training curve (the train
run's per-step MLflow metrics), DLRover-RM's workers after each decision.
MLflow artifacts: resource_model/events.jsonl (plan_resources, train), resource_model/record.json and
resource_model/predicted_vs_measured.png (train).
"""
from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

from recforge.pipelines.outputs import (
    CompileOutputs,
    EvaluateOutputs,
    GenerateOutputs,
    IngestOutputs,
    PlanOutputs,
    PublishOutputs,
    TrainOutputs,
)
from recforge.pipelines.summary import (
    CURVE_METRICS,
    ERROR_TAG,
    PIPELINE,
    RunFacts,
    fmt,
    recorded_events,
    run_status,
    stage_run,
    system_sections,
)
from recforge.ui import charts
from recforge.ui.links import MlflowLinks
from recforge.ui.mlflow_view import PLOT_ARTIFACT, RECORD_ARTIFACT, MlflowRun, MlflowView
from recforge.ui.runs import STAGES, RunRecord, load_plan, read_json

__all__ = ["fmt", "run_detail", "run_summary"]

RAW_JSON_CHARS = 20_000
COMPILE_FIELDS = (
    ("backend", "backend"), ("num_columns", "columns"), ("num_tables", "embedding tables"),
    ("ops_eager", "ops (eager)"), ("ops_compiled", "ops (compiled)"), ("graph_nodes", "graph nodes"),
    ("lookups_eager", "lookups (eager)"), ("lookups_compiled", "lookups (compiled)"),
    ("heldout_rows", "rows checked"), ("max_abs_diff", "max |compiled - eager|"), ("atol", "tolerance"),
    ("within_tolerance", "within tolerance"), ("eager_median_ms", "eager latency (median ms)"),
    ("compiled_median_ms", "compiled latency (median ms)"), ("speedup", "speedup vs eager"),
)
CURVE_LABELS = {"train_loss": "train loss", "train_auc": "train AUC"}


def when(seconds: float | None) -> str:
    if not seconds:
        return "–"
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _num(d: dict | None, key: str) -> float | None:
    v = (d or {}).get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _op_chain(ops: Any) -> str:
    parts = []
    for spec in ops if isinstance(ops, list) else []:
        if not isinstance(spec, dict):
            continue
        params = spec.get("params") or {}
        args = ", ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in params.items()) \
            if isinstance(params, dict) else str(params)
        parts.append(f"{spec.get('op')}({args})")
    return " → ".join(parts)


def facts_of(run: RunRecord, mlruns: dict[str, MlflowRun], ml: MlflowView | None = None) -> RunFacts:
    """recforge.pipelines.summary's facts of a run: its outputs as read here, its MLflow runs' states and errors,
    the parent's params, the train run's latest metrics, DLRover-RM's events (`ml`: read from MLflow where the
    stages did not record them; None: from the outputs only)."""
    facts = RunFacts(
        run.run_key,
        outputs={s: r.outputs for s, r in run.stages.items() if r.outputs is not None},
        unreadable={s: r.problem for s, r in run.stages.items() if r.problem},
        runs={s: stage_run(r.status, r.tags) for s, r in mlruns.items()},
        params=dict(mlruns[PIPELINE].params) if PIPELINE in mlruns else {},
        train_metrics=dict(mlruns["train"].metrics) if "train" in mlruns else {},
    )
    facts.events = recorded_events(
        facts, lambda stage: ml.events(mlruns[stage]) if ml is not None and stage in mlruns else [])
    return facts


def stage_states(run: RunRecord, mlruns: dict[str, MlflowRun], links: MlflowLinks) -> list[dict[str, Any]]:
    """Per stage: done | unreadable | failed (its MLflow run FAILED or KILLED, with the error) | running | missing."""
    rows = []
    for stage in STAGES:
        rec, ml = run.stages[stage], mlruns.get(stage)
        error = None
        if rec.problem:
            state = "unreadable"
        elif rec.done:
            state = "done"
        elif ml is not None and ml.status in ("FAILED", "KILLED"):
            state = "failed"
            error = ml.tags.get(ERROR_TAG) or "no reason recorded"
        elif ml is not None and ml.status == "RUNNING":
            state = "running"
        else:
            state = "missing"
        run_id = (rec.outputs.mlflow_run_id if rec.outputs else None) or (ml.run_id if ml else None)
        exp = ml.experiment_id if ml else None
        rows.append({"name": stage, "state": state, "problem": rec.problem, "error": error, "run_id": run_id,
                     "url": links.run(exp or _exp_of(mlruns), run_id)})
    return rows


def _exp_of(mlruns: dict[str, MlflowRun]) -> str | None:
    return next((r.experiment_id for r in mlruns.values()), None)


def run_summary(run: RunRecord, mlruns: dict[str, MlflowRun], links: MlflowLinks,
                experiment_id: str | None) -> dict:
    """One row of the runs list. `mlruns`: the run's parent ("pipeline") and its stage runs not FINISHED, enough
    to tell a failed run (with the error) from one in progress; a stage whose outputs do not validate is not done."""
    ev, comp, pub = run.read(EvaluateOutputs), run.read(CompileOutputs), run.read(PublishOutputs)
    parent = mlruns.get(PIPELINE)
    params = parent.params if parent else {}
    status = run_status(facts_of(run, mlruns))
    return {
        "run_key": run.run_key, "modified": when(run.modified),
        "state": status["state"], "status": status["text"], "error": status["error"],
        "complete": status["state"] == "complete",
        "auc": fmt(ev.auc if ev else None), "ceiling": fmt(ev.auc_ceiling if ev else None),
        "speedup": fmt(comp.report.speedup if comp else None),
        "model": f"{pub.model_name} v{pub.version}" if pub else None,
        "model_url": links.model_version(pub.model_name, pub.version) if pub else None,
        "promoted": fmt(pub.promoted) if pub else "–",
        "mlflow_url": links.run(experiment_id, parent.run_id if parent else None),
        "params": {k: params[k] for k in ("rows_per_day", "seed", "resources.workers", "resources.policy",
                                          "preprocessing") if k in params},
    }


def system_rows(facts: RunFacts, status: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-system sections, values formatted for the page."""
    out = []
    for sec in system_sections(facts, status):
        d = sec.to_dict()
        for part in ("decided", "did", "measured"):
            d[part] = [(label, fmt(value)) for label, value in d[part]]
        out.append(d)
    return out


def run_detail(run: RunRecord, ml: MlflowView, links: MlflowLinks) -> dict[str, Any]:
    mlruns = ml.stage_runs(run.run_key)
    parent = mlruns.get(PIPELINE)
    exp = ml.experiment_id()
    facts = facts_of(run, mlruns, ml)
    status = run_status(facts)
    page: dict[str, Any] = {
        "run_key": run.run_key, "modified": when(run.modified),
        "status": status,
        "stages": stage_states(run, mlruns, links),
        "pipeline_url": links.run(exp, parent.run_id if parent else None),
        "experiment_url": links.experiment(exp),
        "params": sorted(parent.params.items()) if parent else [],
    }
    problems = [f"{s}: {run.stages[s].problem}" for s in STAGES if run.stages[s].problem]

    def section(name: str, build, *args):
        # a stage that recorded a field in an unexpected shape costs its section, not the page
        try:
            return build(*args)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            problems.append(f"{name} section: recorded outputs not understood ({type(e).__name__}: {e})")
            return None

    page["systems"] = section("systems", system_rows, facts, status) or []
    page["data"] = section("data", _data_section, run)
    page["data_stats"] = section("data_stats", _data_stats_section, run)
    page["plan"] = section("plan", _plan_section, run)
    page["schedule"] = section("schedule", _schedule_section, run)
    page["resources"] = section("resources", _resource_section, run, mlruns, ml, facts.events)
    page["training"] = section("training", _training_section, run, mlruns.get("train"), ml)
    page["evaluation"] = section("evaluation", _evaluation_section, run)
    page["compile"] = section("compile", _compile_section, run)
    page["publish"] = section("publish", _publish_section, run, ml, links, exp)
    page["raw"] = [{"stage": s, "json": _pretty(run.raw(s))} for s in STAGES if run.raw(s) is not None]
    page["problems"] = problems + ml.problems
    return page


def _pretty(data: Any) -> str:
    text = json.dumps(data, indent=2, default=str)
    return text if len(text) <= RAW_JSON_CHARS else text[:RAW_JSON_CHARS] + f"\n… ({len(text):,} characters)"


def _data_section(run: RunRecord) -> dict | None:
    gen, ing = run.read(GenerateOutputs), run.read(IngestOutputs)
    if gen is None and ing is None:
        return None
    rows = []
    if gen is not None:
        rows.append(("source", "synthetic (generated)" if gen.synthetic else "raw day files"))
        rows.append(("day files", fmt(len(gen.files))))
        if gen.bayes_auc:
            rows.append(("Bayes AUC ceiling per day", ", ".join(fmt(a) for a in gen.bayes_auc)))
    if ing is not None:
        for split, part in (("train", ing.train), ("holdout", ing.holdout)):
            rows.append((f"{split} rows (shards, quarantined)",
                         f"{fmt(part.rows)} ({fmt(part.shards)}, {fmt(part.quarantined)})"))
    return {"rows": rows}


STATS_PLOT_BYTES = 4 << 20


def _data_stats_section(run: RunRecord) -> dict | None:
    """ingest's column statistics of the training day(s) and the drift flags against the previous day."""
    ing = run.read(IngestOutputs)
    stats = ing.stats if ing is not None else None
    if stats is None:
        return None
    drifted = set(stats.drifted_columns)
    kinds: dict[str, list[str]] = {}
    for f in stats.flags:
        if f.column is not None:
            kinds.setdefault(f.column, []).append(f.kind)
    columns = [{
        "name": c.name, "role": c.role, "missing_rate": f"{100 * c.missing_rate:.1f} %",
        "distinct": fmt(c.distinct) if c.distinct_exact else f"≈ {fmt(c.distinct)}",
        "min": fmt(c.min), "max": fmt(c.max), "mean": fmt(c.mean),
        "extra": (f"positive rate {100 * c.positive_rate:.2f} %" if c.positive_rate is not None else
                  f"mean length {fmt(c.mean_length)}" if c.mean_length is not None else ""),
        "drift": c.name in drifted, "kinds": ", ".join(kinds.get(c.name, [])),
    } for c in stats.columns]
    plot_file = run.inside(stats.plot_path, "ingest")
    plot = None
    if plot_file is not None and plot_file.stat().st_size <= STATS_PLOT_BYTES:
        plot = base64.b64encode(plot_file.read_bytes()).decode()
    return {
        "split": stats.split, "day": stats.day or "undated run", "rows": fmt(stats.rows),
        "previous_day": stats.previous_day, "compared": stats.previous_stats is not None,
        "flags": [{"column": f.column or "(all rows)", "kind": f.kind, "message": f.message} for f in stats.flags],
        "columns": columns, "plot": plot,
    }


def _plan_section(run: RunRecord) -> dict | None:
    out = run.read(PlanOutputs)
    if out is None:
        return None
    plan, problem = load_plan(run)
    features = []
    for f in (plan or {}).get("features", []):
        if isinstance(f, dict):
            features.append({"name": f.get("name"), "kind": f.get("kind"), "source": f.get("source"),
                             "chain": _op_chain(f.get("ops")), "table_rows": fmt(f.get("table_rows"))})
    chains: dict[tuple[str, str], list[str]] = {}
    for f in features:
        ops = " → ".join(part.split("(")[0] for part in f["chain"].split(" → ")) if f["chain"] else "–"
        chains.setdefault((str(f["kind"]), ops), []).append(str(f["name"]))
    fusion = out.fusion
    schedule, _ = _corun_schedule(run, out)
    placed: dict[str, list[str]] = {}  # group -> "stage (ms)" of each of its co-run assignments
    for a in (schedule or {}).get("assignments") or []:
        if isinstance(a, dict):
            placed.setdefault(str(a.get("group")), []).append(f"{a.get('stage')} ({fmt(_num(a, 'predicted_ms'))} ms)")
    names = [g if isinstance(g, str) else json.dumps(g, default=str) for g in (fusion or {}).get("groups") or []]
    groups_from = "RAP's plan compiler (plan_resources fusion)" if names else None
    if not names and placed:
        names, groups_from = list(placed), "the co-run schedule"
    groups = [{"name": g, "stages": ", ".join(placed.get(g, [])) or "–"} for g in names]
    return {
        "name": (plan or {}).get("name"), "problem": problem, "features": features,
        "chains": [{"kind": k, "ops": ops, "count": len(names), "features": _name_span(names)}
                   for (k, ops), names in chains.items()],
        "dense": sum(f["kind"] == "dense" for f in features), "sparse": sum(f["kind"] == "sparse" for f in features),
        "fusion": [(k, fmt(v)) for k, v in (fusion or {}).items() if not isinstance(v, (list, dict))],
        "groups": groups, "groups_from": groups_from, "corun": schedule is not None,
    }


def _name_span(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, … {names[-1]}"


def _corun_schedule(run: RunRecord, out: PlanOutputs) -> tuple[dict | None, str | None]:
    """The co-run schedule file plan_resources recorded (corun.schedule_path), parsed; (None, why) without one."""
    if out.corun is None:
        return None, None
    path = run.inside(out.corun.schedule_path, "plan_resources")
    if path is None:
        return None, "the co-run schedule file recorded by plan_resources is missing"
    data, problem = read_json(path)
    if problem is None and not isinstance(data, dict):
        return None, "the co-run schedule file holds no object"
    return data, problem


def _gantt(stage: str, title: str, build) -> dict[str, Any]:
    try:
        return {"stage": stage, "title": title, "chart": charts.gantt(build()), "problem": None}
    except charts.ChartError as e:
        return {"stage": stage, "title": title, "chart": None, "problem": str(e)}


def _schedule_section(run: RunRecord) -> list[dict[str, Any]] | None:
    """RAP's Gantt charts: as planned (plan_resources `rap_schedule`, else its co-run schedule file over the
    profiled stage times) and as run (train `rap_schedule`)."""
    plan, train = run.read(PlanOutputs), run.read(TrainOutputs)
    out: list[dict[str, Any]] = []
    if plan is not None and plan.rap_schedule is not None:
        out.append(_gantt("plan_resources", "planned", lambda: plan.rap_schedule))
    elif plan is not None and plan.corun is not None:
        schedule, problem = _corun_schedule(run, plan)
        profile = plan.corun.profile
        meta = (schedule or {}).get("meta") or {}
        stage_ms = profile.stage_ms if profile else meta.get("stage_ms")
        capacity_ms = profile.capacity_ms if profile else meta.get("capacity_ms")
        if problem:
            out.append({"stage": "plan_resources", "title": "planned", "chart": None, "problem": problem})
        else:
            out.append(_gantt("plan_resources", "planned, over the profiled stage times",
                              lambda: charts.corun_gantt(schedule, stage_ms, capacity_ms)))
    if train is not None and train.rap_schedule is not None:
        out.append(_gantt("train", "as run", lambda: train.rap_schedule))
    return out or None


DECISION_STAGES = ("warm_start", "runtime", "instability")  # recforge.elastic.optimizer.events.STAGES


def _event_time(t: float | None) -> str:
    if t is None:
        return "–"
    return when(t) if t > 1e9 else f"{t:.1f} s into the job"


def _workers_of(plan: Any) -> float | None:
    return _num(plan, "workers") if isinstance(plan, dict) else None


def _resource_section(run: RunRecord, mlruns: dict[str, MlflowRun], ml: MlflowView,
                      events: list[dict[str, Any]]) -> dict | None:
    """`events`: DLRover-RM's, as recorded (recforge.pipelines.summary.recorded_events)."""
    plan_out, train_out = run.read(PlanOutputs), run.read(TrainOutputs)
    train_run = mlruns.get("train")
    plot = ml.artifact_png(train_run, PLOT_ARTIFACT) if train_run else None
    record = ml.artifact_json(train_run, RECORD_ARTIFACT) if train_run else None
    if plan_out is None and not events and plot is None:
        return None
    decisions: list[dict[str, Any]] = []
    points: list[tuple[float, float]] = []  # (decision number, workers)
    # DLRover-RM's stages in order; within one, by time (warm-start events carry wall-clock seconds, runtime
    # events seconds into the job, so times are shown as recorded, never subtracted across stages)
    order = {stage: i for i, stage in enumerate(DECISION_STAGES)}
    events = sorted(events, key=lambda e: (order.get(str(e.get("stage")), len(order)), _num(e, "time_s") or 0.0))
    for i, e in enumerate(events):
        after, before = e.get("plan_after"), e.get("plan_before")
        decisions.append({
            "n": i + 1, "t": _event_time(_num(e, "time_s")), "stage": str(e.get("stage", "")),
            "action": str(e.get("action", "")), "reason": str(e.get("reason", "")),
            "before": json.dumps(before, default=str) if before is not None else "–",
            "after": json.dumps(after, default=str) if after is not None else "–",
            "executed": fmt(bool(e.get("executed"))),
        })
        if not points and (w0 := _workers_of(before)) is not None:
            points.append((0, w0))
        w = _workers_of(after) if after is not None else _workers_of(before)
        if w is not None:
            points.append((i + 1, w))
    model_rows = []
    if train_run is not None:
        model_rows = [(k.removeprefix("resource_model."), fmt(v)) for k, v in sorted(train_run.metrics.items())
                      if k.startswith("resource_model.")]
    if isinstance(record, dict) and isinstance(record.get("final_plan"), dict):
        model_rows.insert(0, ("final plan", json.dumps(record["final_plan"], default=str)))
    pipeline_run = mlruns.get("pipeline")
    return {
        "policy": pipeline_run.params.get("resources.policy") if pipeline_run else None,
        "workers": fmt(plan_out.workers if plan_out else None),
        "threads": fmt(plan_out.threads_per_worker if plan_out else None),
        "world_size": fmt(train_out.world_size if train_out else None),
        "decisions": decisions,
        "chart": charts.step_series(points, "workers", x_label="decision") if len(points) > 1 else None,
        "plot": base64.b64encode(plot).decode() if plot else None, "model_rows": model_rows,
    }


def _training_section(run: RunRecord, train_run: MlflowRun | None, ml: MlflowView) -> dict | None:
    """What train recorded, and the training curve: the train run's per-step metrics (also while it runs)."""
    out = run.read(TrainOutputs)
    curves = []
    if train_run is not None:
        for key in CURVE_METRICS:
            chart = charts.line_series(ml.metric_history(train_run, key), CURVE_LABELS.get(key, key))
            if chart is not None:
                curves.append({"metric": key, "chart": chart})
    if out is None and not curves:
        return None
    rows = []
    if out is not None:
        rows = [("samples/s", fmt(out.samples_per_s)), ("steps", fmt(out.steps)),
                ("workers (world size)", fmt(out.world_size)), ("wall time (s)", fmt(out.wall_s)),
                ("preprocessing the workers ran", fmt(out.preprocessing))]
    if train_run and "final_train_loss" in train_run.metrics:
        rows.append(("final train loss", fmt(train_run.metrics["final_train_loss"])))
    return {"rows": rows, "curves": curves, "in_progress": out is None}


def _evaluation_section(run: RunRecord) -> dict | None:
    ev = run.read(EvaluateOutputs)
    if ev is None:
        return None
    auc, ceiling = ev.auc, ev.auc_ceiling
    rows = [("AUC", fmt(auc)), ("AUC ceiling (Bayes-optimal)", fmt(ceiling))]
    if auc is not None and ceiling is not None:
        rows.append(("gap to ceiling", fmt(ceiling - auc)))
        # AUC 0.5 is chance: the share of the attainable lift over chance the model reached
        if ceiling > 0.5:
            rows.append(("lift over chance reached", f"{100 * (auc - 0.5) / (ceiling - 0.5):.1f} %"))
    rows += [("log loss", fmt(ev.logloss)), ("normalized entropy", fmt(ev.ne)), ("rows evaluated", fmt(ev.rows))]
    champ = ev.champion
    if champ is not None:
        rows += [(f"champion v{champ.version}: AUC, same day", fmt(champ.auc)),
                 (f"champion v{champ.version}: log loss", fmt(champ.logloss)),
                 (f"champion v{champ.version}: rows evaluated", fmt(champ.rows))]
    else:
        rows.append(("champion on the same day", "no champion yet"))
    return {"rows": rows, "auc": auc, "ceiling": ceiling}


def _compile_section(run: RunRecord) -> dict | None:
    out = run.read(CompileOutputs)
    if out is None:
        return None
    report = out.report
    rows = [(label, fmt(getattr(report, key))) for key, label in COMPILE_FIELDS if key in report.model_fields_set]
    lat = report.latency
    if lat is not None:
        rows.append(("latency measured at", f"batch {fmt(lat.batch_size)}, {fmt(lat.threads)} thread(s)"))
    # fields the report model does not declare: the embedding groups get their own table, the rest show as they are
    extras = report.extras
    group_fields = ("signature_groups", "fused_groups")
    other = [(k, fmt(v) if not isinstance(v, (dict, list)) else json.dumps(v, default=str))
             for k, v in extras.items() if k not in group_fields]
    groups = extras.get("signature_groups") or extras.get("fused_groups") or {}
    if isinstance(groups, list):
        groups = {str(g): "" for g in groups}
    bars = []
    eager, compiled = report.eager_median_ms, report.compiled_median_ms
    if eager and compiled:
        top = max(eager, compiled)
        bars = [{"label": "eager", "ms": fmt(eager), "pct": round(100 * eager / top, 1)},
                {"label": "compiled", "ms": fmt(compiled), "pct": round(100 * compiled / top, 1)}]
    return {"rows": rows, "other": other, "groups": [(str(k), fmt(v)) for k, v in groups.items()]
            if isinstance(groups, dict) else [], "bars": bars}


def _publish_section(run: RunRecord, ml: MlflowView, links: MlflowLinks, exp: str | None) -> dict | None:
    pub = run.read(PublishOutputs)
    if pub is None:
        return None
    name, version = pub.model_name, pub.version
    mv = ml.model_version(name, version)
    return {
        "model": f"{name} v{version}", "url": links.model_version(name, version),
        "promoted": fmt(pub.promoted), "reason": pub.reason,
        "challenger_auc": fmt(pub.challenger_auc), "champion_auc": fmt(pub.champion_auc),
        "aliases": ", ".join(mv["aliases"]) if mv and mv["aliases"] else "–",
        "status": mv["status"] if mv else "–",
        "source_run_url": links.run(exp, mv["run_id"]) if mv else None,
    }
