"""Turn a run's recorded outputs and its MLflow runs into the page's sections; a section exists only where its
data does. Pure data (strings, numbers, lists): the templates render it with escaping on.

Each stage's outputs are read as its model (recforge.pipelines.outputs); a file that does not validate is listed
under the problems with the fields, and still shows raw under "recorded outputs". Optional fields that get their own
section: plan_resources/train `rap_schedule` (Gantt), `resource_decisions` (event dicts), plan_resources `fusion`;
compile report fields the model does not declare show as they are.
MLflow artifacts: resource_model/events.jsonl (plan_resources, train), resource_model/record.json and
resource_model/predicted_vs_measured.png (train).
"""
from __future__ import annotations

import base64
import json
import math
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
from recforge.ui import charts
from recforge.ui.links import MlflowLinks
from recforge.ui.mlflow_view import EVENTS_ARTIFACT, PLOT_ARTIFACT, RECORD_ARTIFACT, MlflowRun, MlflowView
from recforge.ui.runs import STAGES, RunRecord, load_plan

RAW_JSON_CHARS = 20_000
COMPILE_FIELDS = (
    ("backend", "backend"), ("num_columns", "columns"), ("num_tables", "embedding tables"),
    ("ops_eager", "ops (eager)"), ("ops_compiled", "ops (compiled)"), ("graph_nodes", "graph nodes"),
    ("lookups_eager", "lookups (eager)"), ("lookups_compiled", "lookups (compiled)"),
    ("heldout_rows", "rows checked"), ("max_abs_diff", "max |compiled - eager|"), ("atol", "tolerance"),
    ("within_tolerance", "within tolerance"), ("eager_median_ms", "eager latency (median ms)"),
    ("compiled_median_ms", "compiled latency (median ms)"), ("speedup", "speedup vs eager"),
)


def fmt(value: Any) -> str:
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


def stage_states(run: RunRecord, mlruns: dict[str, MlflowRun], links: MlflowLinks) -> list[dict[str, Any]]:
    rows = []
    for stage in STAGES:
        rec, ml = run.stages[stage], mlruns.get(stage)
        if rec.problem:
            state = "unreadable"
        elif rec.done:
            state = "done"
        elif ml is not None and ml.status in ("FAILED", "KILLED"):
            state = "failed"
        elif ml is not None and ml.status == "RUNNING":
            state = "running"
        else:
            state = "missing"
        run_id = (rec.outputs.mlflow_run_id if rec.outputs else None) or (ml.run_id if ml else None)
        exp = ml.experiment_id if ml else None
        rows.append({"name": stage, "state": state, "problem": rec.problem, "run_id": run_id,
                     "url": links.run(exp or _exp_of(mlruns), run_id)})
    return rows


def _exp_of(mlruns: dict[str, MlflowRun]) -> str | None:
    return next((r.experiment_id for r in mlruns.values()), None)


def run_summary(run: RunRecord, parent: MlflowRun | None, links: MlflowLinks, experiment_id: str | None) -> dict:
    """One row of the runs list (a stage whose outputs do not validate counts as not done)."""
    ev, comp, pub = run.read(EvaluateOutputs), run.read(CompileOutputs), run.read(PublishOutputs)
    params = parent.params if parent else {}
    failed_at = next((s for s in STAGES if not run.stages[s].done), None)
    return {
        "run_key": run.run_key, "modified": when(run.modified),
        "status": "complete" if failed_at is None else f"{len(run.done)}/{len(STAGES)} stages (next: {failed_at})",
        "complete": failed_at is None,
        "auc": fmt(ev.auc if ev else None), "ceiling": fmt(ev.auc_ceiling if ev else None),
        "speedup": fmt(comp.report.speedup if comp else None),
        "model": f"{pub.model_name} v{pub.version}" if pub else None,
        "model_url": links.model_version(pub.model_name, pub.version) if pub else None,
        "promoted": fmt(pub.promoted) if pub else "–",
        "mlflow_url": links.run(experiment_id, parent.run_id if parent else None),
        "params": {k: params[k] for k in ("rows_per_day", "seed", "resources.workers") if k in params},
    }


def run_detail(run: RunRecord, ml: MlflowView, links: MlflowLinks) -> dict[str, Any]:
    mlruns = ml.stage_runs(run.run_key)
    parent = mlruns.get("pipeline")
    exp = ml.experiment_id()
    page: dict[str, Any] = {
        "run_key": run.run_key, "modified": when(run.modified),
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

    page["data"] = section("data", _data_section, run)
    page["plan"] = section("plan", _plan_section, run)
    page["schedule"] = section("schedule", _schedule_section, run)
    page["resources"] = section("resources", _resource_section, run, mlruns, ml)
    page["training"] = section("training", _training_section, run, mlruns.get("train"))
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
    groups = []
    if fusion:
        for g in fusion.get("groups") or []:
            groups.append(g if isinstance(g, str) else json.dumps(g, default=str))
    return {
        "name": (plan or {}).get("name"), "problem": problem, "features": features,
        "chains": [{"kind": k, "ops": ops, "count": len(names), "features": _name_span(names)}
                   for (k, ops), names in chains.items()],
        "dense": sum(f["kind"] == "dense" for f in features), "sparse": sum(f["kind"] == "sparse" for f in features),
        "fusion": [(k, fmt(v)) for k, v in (fusion or {}).items() if not isinstance(v, (list, dict))],
        "groups": groups,
    }


def _name_span(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, … {names[-1]}"


def _schedule_section(run: RunRecord) -> dict | None:
    for out in (run.read(PlanOutputs), run.read(TrainOutputs)):
        schedule = out.rap_schedule if out is not None else None
        if out is not None and schedule is not None:
            try:
                return {"stage": out.stage, "chart": charts.gantt(schedule), "problem": None}
            except charts.ChartError as e:
                return {"stage": out.stage, "chart": None, "problem": str(e)}
    return None


DECISION_STAGES = ("warm_start", "runtime", "instability")  # recforge.elastic.optimizer.events.STAGES


def _event_time(t: float | None) -> str:
    if t is None:
        return "–"
    return when(t) if t > 1e9 else f"{t:.1f} s into the job"


def _workers_of(plan: Any) -> float | None:
    return _num(plan, "workers") if isinstance(plan, dict) else None


def _resource_section(run: RunRecord, mlruns: dict[str, MlflowRun], ml: MlflowView) -> dict | None:
    plan_out, train_out = run.read(PlanOutputs), run.read(TrainOutputs)
    events: list[dict] = []
    for stage, out in (("plan_resources", plan_out), ("train", train_out)):
        recorded = out.resource_decisions if out is not None else None
        if recorded is not None:
            events += recorded
        elif stage in mlruns:
            events += ml.artifact_jsonl(mlruns[stage], EVENTS_ARTIFACT)
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


def _training_section(run: RunRecord, train_run: MlflowRun | None) -> dict | None:
    out = run.read(TrainOutputs)
    if out is None:
        return None
    rows = [("samples/s", fmt(out.samples_per_s)), ("steps", fmt(out.steps)),
            ("workers (world size)", fmt(out.world_size)), ("wall time (s)", fmt(out.wall_s))]
    if train_run and "final_train_loss" in train_run.metrics:
        rows.append(("final train loss", fmt(train_run.metrics["final_train_loss"])))
    return {"rows": rows}


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
        "aliases": ", ".join(mv["aliases"]) if mv and mv["aliases"] else "–",
        "status": mv["status"] if mv else "–",
        "source_run_url": links.run(exp, mv["run_id"]) if mv else None,
    }
