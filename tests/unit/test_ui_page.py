"""The RecForge page (recforge.ui.app) on runs written the way the stages write them (StageWriter) and MLflow
runs created through recforge.tracking: every section where its data exists, nothing where it does not, links
into MLflow, escaping of everything, read-only, and bad run keys refused."""
import json
import re

import pytest
from fastapi.testclient import TestClient

from recforge.config import PipelineConfig, dataset_preset
from recforge.pipelines.context import EXPERIMENT, RunContext, StageWriter
from recforge.pipelines.outputs import (
    CompileOutputs,
    EvaluateOutputs,
    GenerateOutputs,
    IngestOutputs,
    PlanOutputs,
    PublishOutputs,
    SplitOutputs,
    StageOutputs,
    TrainOutputs,
)
from recforge.pipelines.summary import summarize
from recforge.preprocess.planning.plan import criteo_plan
from recforge.tracking import TrackingStore
from recforge.tracking.store import ERROR_TAG, FAILED_STAGE_TAG
from recforge.ui.app import create_app
from recforge.ui.links import mlflow_base
from recforge.ui.mlflow_view import MlflowView
from ui_run_fixtures import (
    CORUN,
    FAILED,
    GROUPS,
    INLINE,
    RUNNING,
    TRAIN_ERROR,
    corun_run,
    inline_run,
    stopped_at_train,
)

EVIL = '<script>alert("x")</script>'
EVIL_IMG = "<img src=x onerror=alert(1)>"
MLFLOW = "http://mlflow.example:5000"
COMPLETE, PARTIAL, CORRUPT, EMPTY = "manual__2026-01-02T00_00_00_00_00", "partial_run", "corrupt_run", "queued_run"


def _write(ctx: RunContext, outputs: StageOutputs) -> StageOutputs:
    return StageWriter(ctx, outputs.stage).commit(outputs)


def _write_raw(ctx: RunContext, stage: str, text: str) -> None:
    """An outputs.json as an older or broken writer left it (the page must cope)."""
    ctx.stage_dir(stage).mkdir(parents=True)
    (ctx.stage_dir(stage) / "outputs.json").write_text(text)


def _split(rows: int, quarantined: int = 0, shards: int = 1) -> SplitOutputs:
    return SplitOutputs(manifest_dir="unused", rows=rows, quarantined=quarantined, shards=shards)


def _job() -> dict:
    return {"exit_code": 0, "plan": {"workers": 2, "threads_per_worker": 1}, "finished": True, "tasks_done": 4,
            "samples": 3000, "per_worker": {}, "poisoned": [], "master_state": {}}


def _stage_runs(store: TrackingStore, ctx: RunContext, stages, status="FINISHED") -> dict:
    parent = store.pipeline_run(EXPERIMENT, ctx.run_key)
    store.log_params(parent, ctx.config.model_dump(mode="json"))
    ids = {}
    for s in stages:
        ids[s] = store.stage_run(EXPERIMENT, ctx.run_key, s)
        store.finish(ids[s], ok=status == "FINISHED")
    return {"pipeline": parent, **ids}


def _complete_run(home, store: TrackingStore) -> dict:
    from recforge.elastic.optimizer.events import Event
    from recforge.tracking.resource_models import log_events

    ctx = RunContext.create(COMPLETE, PipelineConfig(rows_per_day=3000, seed=7, table_cap=5000), home=home)
    ids = _stage_runs(store, ctx, ["generate", "ingest", "plan_resources", "train", "evaluate", "compile", "publish"])
    _write(ctx, GenerateOutputs(files=["day_0.tsv", "day_1.tsv"], bayes_auc=[0.79, 0.78], synthetic=True,
                                mlflow_run_id=ids["generate"]))
    _write(ctx, IngestOutputs(train=_split(3000, 2), holdout=_split(3000), rows_ingested=6000, rows_quarantined=2,
                              mlflow_run_id=ids["ingest"]))
    plan = json.loads(criteo_plan(dataset_preset("criteo_kaggle"), 5000).model_dump_json())
    plan["features"][0]["name"] = EVIL  # a hostile plan file: the page must escape what it reads
    schedule = {"unit": "ms", "tasks": [
        {"name": "fill_null", "lane": "cpu0", "start": 0, "end": 4, "kind": "dense"},
        {"name": EVIL, "lane": "cpu1", "start": 1, "end": 9, "kind": "sparse"},
        {"name": "train step", "lane": "gpu0", "start": 4, "end": 10, "kind": "train"}]}
    w = StageWriter(ctx, "plan_resources")
    (w.tmp / "preprocess_plan.json").write_text(json.dumps(plan))
    w.commit(PlanOutputs(plan_path=str(w.tmp / "preprocess_plan.json"), workers=2, threads_per_worker=1,
                         tables=[("C1", 5000)], num_dense=13, preprocess_executor="fused", rap_schedule=schedule,
                         fusion={"method": "milp", "objective": 1370, "launches": 3,
                                 "groups": ["L0:fill_null_densex13", f"L1:{EVIL}", "L2:firstx_sparsex26"]},
                         mlflow_run_id=ids["plan_resources"]))
    events = [Event("warm_start", "initial_plan", "no history: " + EVIL, plan_after={"workers": 2}, time_s=100.0),
              Event("runtime", "add_worker", "throughput below the model", plan_before={"workers": 2},
                    plan_after={"workers": 3}, time_s=130.0)]
    log_events(store, ids["train"], events)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([1, 2], [3, 4])
    store.log_figure(ids["train"], fig, "resource_model/predicted_vs_measured.png")
    plt.close(fig)
    store.log_metrics(ids["train"], {"final_train_loss": 0.52, "resource_model.fit_mape": 0.07})
    _write(ctx, TrainOutputs(checkpoint_dir="unused", samples_per_s=4800.5, steps=8, wall_s=9.5, world_size=2,
                             samples_trained=[3000], job=_job(), mlflow_run_id=ids["train"]))
    _write(ctx, EvaluateOutputs(auc=0.70, logloss=0.55, ne=0.97, rows=3000, auc_ceiling=0.78,
                                mlflow_run_id=ids["evaluate"]))
    _write(ctx, CompileOutputs(artifact="inference.pt2", mlflow_run_id=ids["compile"], report={
        "backend": EVIL_IMG, "num_columns": 26, "num_tables": 26, "ops_eager": 78, "ops_compiled": 83,
        "max_abs_diff": 1.5e-7, "atol": 1e-5, "within_tolerance": True, "eager_median_ms": 1.0,
        "compiled_median_ms": 0.25, "speedup": 4.0,
        "latency": {"batch_size": 64, "threads": 1, "eager": {"median_ms": 1.0}, "compiled": {"median_ms": 0.25}},
        "signature_groups": {"sigrid_hash|sum|rows|dim<=16": 26}, "new_field_from_a_later_issue": EVIL}))
    client = store.client
    client.create_registered_model("recforge-dlrm")
    mv = client.create_model_version("recforge-dlrm", source=f"runs:/{ids['publish']}/model", run_id=ids["publish"])
    client.set_registered_model_alias("recforge-dlrm", "champion", mv.version)
    _write(ctx, PublishOutputs(model_name="recforge-dlrm", version=str(mv.version), promoted=True, reason=EVIL,
                               pipeline_run_id=ids["pipeline"], mlflow_run_id=ids["publish"]))
    return ids


def _partial_run(home, store: TrackingStore) -> dict:
    ctx = RunContext.create(PARTIAL, PipelineConfig(rows_per_day=1000), home=home)
    ids = _stage_runs(store, ctx, ["generate", "ingest"])
    ids["plan_resources"] = store.stage_run(EXPERIMENT, ctx.run_key, "plan_resources")
    store.finish(ids["plan_resources"], ok=False)
    _write(ctx, GenerateOutputs(files=[], synthetic=False, mlflow_run_id=ids["generate"]))
    _write(ctx, IngestOutputs(train=_split(10), holdout=_split(5), rows_ingested=15, rows_quarantined=0,
                              mlflow_run_id=ids["ingest"]))
    return ids


ALL_STAGES = ["generate", "ingest", "plan_resources", "train", "evaluate", "compile", "publish"]
LOSS = [0.69 - 0.01 * i for i in range(12)]  # train_loss per step, as the training loop logs it


def _log_curve(store: TrackingStore, run_id: str) -> None:
    for step, loss in enumerate(LOSS):
        store.log_metrics(run_id, {"train_loss": loss, "train_auc": 0.5 + 0.01 * step}, step=step)
    store.log_metrics(run_id, {"train_loss": LOSS[5]}, step=5)  # a resumed attempt logs step 5 again


def _corun_run(home, store: TrackingStore) -> dict:
    """Every system used; DLRover-RM's events recorded in the outputs; a measured Gantt from the train task."""
    ctx = RunContext.create(CORUN, PipelineConfig(rows_per_day=3000), home=home)
    ids = _stage_runs(store, ctx, ALL_STAGES)
    _log_curve(store, ids["train"])
    store.log_metrics(ids["train"], {"rap_measured_iteration_ms": 17.25})
    events = [{"stage": "warm_start", "action": "initial_plan", "reason": "2 similar jobs: greedy search",
               "prediction": {"samples_per_s": 4400.0}, "plan_after": {"workers": 2}, "time_s": 100.0}]
    measured = {"unit": "ms", "tasks": [{"name": "emb_fwd", "lane": "train (measured)", "start": 0, "end": 4.5,
                                         "kind": "training stage"}]}
    corun_run(ctx, ids, events=events, train_schedule=measured)
    return ids


def _inline_run(home, store: TrackingStore) -> dict:
    ctx = RunContext.create(INLINE, PipelineConfig(rows_per_day=3000, resources={"policy": "static"}), home=home)
    ids = _stage_runs(store, ctx, ALL_STAGES)
    inline_run(ctx, ids)
    return ids


def _failed_run(home, store: TrackingStore) -> dict:
    """train failed: its run FAILED with the error, the parent FAILED naming the stage (as run_stage leaves them)."""
    ctx = RunContext.create(FAILED, PipelineConfig(rows_per_day=3000), home=home)
    ids = _stage_runs(store, ctx, ALL_STAGES[:3])
    ids["train"] = store.stage_run(EXPERIMENT, ctx.run_key, "train")
    store.client.set_tag(ids["train"], ERROR_TAG, TRAIN_ERROR)
    store.client.set_terminated(ids["train"], "FAILED")
    store.client.set_tag(ids["pipeline"], FAILED_STAGE_TAG, "train")
    store.client.set_tag(ids["pipeline"], ERROR_TAG, f"stage train failed: {TRAIN_ERROR}")
    store.client.set_terminated(ids["pipeline"], "FAILED")
    stopped_at_train(ctx, ids)
    return ids


def _running_run(home, store: TrackingStore) -> dict:
    """train still running: its run open, the curve logged so far."""
    ctx = RunContext.create(RUNNING, PipelineConfig(rows_per_day=3000), home=home)
    ids = _stage_runs(store, ctx, ALL_STAGES[:3])
    ids["train"] = store.stage_run(EXPERIMENT, ctx.run_key, "train")
    _log_curve(store, ids["train"])
    stopped_at_train(ctx, ids)
    return ids


@pytest.fixture(scope="module")
def site(tmp_path_factory, mlflow_db):
    home = tmp_path_factory.mktemp("ui_home")
    store = TrackingStore(mlflow_db(home / "mlflow" / "mlflow.db"), home / "mlflow" / "artifacts")
    ids = {PARTIAL: _partial_run(home, store), COMPLETE: _complete_run(home, store),
           CORUN: _corun_run(home, store), INLINE: _inline_run(home, store), FAILED: _failed_run(home, store),
           RUNNING: _running_run(home, store)}
    corrupt = RunContext.create(CORRUPT, {}, home=home)
    _write(corrupt, GenerateOutputs(files=[], synthetic=False))
    _write_raw(corrupt, "ingest", "{not json")
    RunContext.create(EMPTY, {}, home=home).run_dir.mkdir(parents=True)
    exp = store.client.get_experiment_by_name(EXPERIMENT).experiment_id
    app = create_app(allow_anonymous=True, home=home, tracking_uri=store.tracking_uri, mlflow_url=MLFLOW)
    return {"client": TestClient(app), "ids": ids, "exp": exp, "home": home, "store": store}


def _html(site, path: str) -> str:
    r = site["client"].get(path, headers={"accept": "text/html"})
    assert r.status_code == 200, r.text[:2000]
    assert r.headers["content-type"].startswith("text/html")
    return r.text


def _escaped_everywhere(body: str) -> None:
    assert "<script" not in body.lower() and "<img src=x" not in body.lower()
    assert "onerror=alert" not in body or "&lt;img src=x onerror=alert(1)&gt;" in body


def test_index_lists_every_run_with_its_results_and_links(site):
    body = _html(site, "/")
    _escaped_everywhere(body)
    keys = re.findall(r'data-run-key="([^"]+)"', body)
    assert set(keys) == {COMPLETE, PARTIAL, CORRUPT, EMPTY, CORUN, INLINE, FAILED, RUNNING}
    ids, exp = site["ids"][COMPLETE], site["exp"]
    row = body.split(f'data-run-key="{COMPLETE}"')[1].split("</tr>")[0]
    assert "complete" in row and "0.7" in row and "4" in row
    assert f'href="{MLFLOW}/#/models/recforge-dlrm/versions/1"' in row
    assert f'href="{MLFLOW}/#/experiments/{exp}/runs/{ids["pipeline"]}"' in row
    assert "rows_per_day=3000" in row and "seed=7" in row
    partial = body.split(f'data-run-key="{PARTIAL}"')[1].split("</tr>")[0]
    assert 'data-state="failed"' in partial and "failed at plan_resources" in partial
    assert f'href="/runs/{COMPLETE}"' in body


def _index_row(body: str, key: str) -> str:
    return body.split(f'data-run-key="{key}"')[1].split("</tr>")[0]


def test_index_tells_failed_runs_with_their_error_from_running_ones(site):
    body = _html(site, "/")
    states = dict(re.findall(r'data-run-key="([^"]+)">.*?data-state="(\w+)"', body, re.S))
    assert states == {COMPLETE: "complete", CORUN: "complete", INLINE: "complete", PARTIAL: "failed",
                      FAILED: "failed", RUNNING: "running", CORRUPT: "failed", EMPTY: "incomplete"}
    failed = _index_row(body, FAILED)
    assert f"failed at train: {TRAIN_ERROR}" in failed and "running" not in failed
    running = _index_row(body, RUNNING)
    assert "running: train" in running and "failed" not in running
    assert "0/7 stages (next: generate)" in _index_row(body, EMPTY)
    rows = {r["run_key"]: r for r in site["client"].get("/api/runs").json()["runs"]}
    assert rows[FAILED]["state"] == "failed" and rows[FAILED]["error"] == TRAIN_ERROR
    assert rows[RUNNING]["state"] == "running" and rows[RUNNING]["error"] is None


def test_complete_run_shows_every_section_linked_to_mlflow(site):
    body = _html(site, f"/runs/{COMPLETE}")
    _escaped_everywhere(body)
    ids, exp = site["ids"][COMPLETE], site["exp"]
    for stage in ("generate", "ingest", "plan_resources", "train", "evaluate", "compile", "publish"):
        assert f'data-stage="{stage}" data-state="done"' in body
        assert f'href="{MLFLOW}/#/experiments/{exp}/runs/{ids[stage]}"' in body
    # plan: op chains grouped, every feature listed, fused groups
    assert "fill_null → sigrid_hash → firstx" in body and "fill_null → logit" in body
    assert body.count("<tr><td class=\"mono\">") >= 39
    assert "L0:fill_null_densex13" in body and "3 launches" in body
    # Gantt: one bar per task, lanes in order of appearance
    gantt = body.split('aria-label="RAP schedule Gantt chart"')[1].split("</svg>")[0]
    assert gantt.count("<rect") == 3 and gantt.index("cpu0") < gantt.index("cpu1") < gantt.index("gpu0")
    # resource decisions from the events artifact, the workers-over-time chart and the fitted model's plot
    decisions = body.split('id="decisions"')[1].split("</table>")[0]
    assert decisions.count("<tr>") == 3 and "add_worker" in decisions
    assert decisions.index("initial_plan") < decisions.index("add_worker")  # warm start first
    assert "130.0 s into the job" in decisions
    assert 'aria-label="workers after each decision"' in body
    assert 'src="data:image/png;base64,iVBORw0KGgo' in body and "fit_mape" in body
    # evaluation vs ceiling, compile report, model
    assert "0.08" in body.split('id="evaluation"')[1].split('id="compile"')[0]  # gap 0.78 - 0.70
    assert "71.4 %" in body  # (0.70 - 0.5) / (0.78 - 0.5)
    compile_section = body.split('id="compile"')[1].split('id="publish"')[0]
    for text in ("speedup vs eager", "4", "1.500e-07", "sigrid_hash|sum|rows|dim&lt;=16",
                 "new_field_from_a_later_issue"):
        assert text in compile_section
    publish = body.split('id="publish"')[1].split('id="raw"')[0]
    assert f'href="{MLFLOW}/#/models/recforge-dlrm/versions/1"' in publish and "champion" in publish
    assert f"{MLFLOW}/#/experiments/{exp}/runs/{ids['publish']}" in publish
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in body


def test_partial_run_shows_what_exists(site):
    body = _html(site, f"/runs/{PARTIAL}")
    states = dict(re.findall(r'data-stage="(\w+)" data-state="(\w+)"', body))
    assert states == {"generate": "done", "ingest": "done", "plan_resources": "failed", "train": "missing",
                      "evaluate": "missing", "compile": "missing", "publish": "missing"}
    for empty in ("No plan recorded yet", "No training outputs yet", "Not evaluated yet", "Not compiled yet",
                  "Not published yet", "No RAP schedule yet"):
        assert empty in body
    assert "generate/outputs.json" in body and "compile/outputs.json" not in body
    data = site["client"].get(f"/api/runs/{PARTIAL}").json()
    assert data["plan"] is None and data["compile"] is None and data["data"] is not None


def test_unreadable_outputs_and_empty_runs_are_reported_not_fatal(site):
    body = _html(site, f"/runs/{CORRUPT}")
    assert 'data-stage="ingest" data-state="unreadable"' in body
    assert "ingest: outputs.json unreadable: JSONDecodeError" in body
    body = _html(site, f"/runs/{EMPTY}")
    assert body.count('data-state="missing"') == 7 and "No stage has recorded outputs" in body


def test_mlflow_unreachable_still_shows_the_recorded_outputs(site, tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    app = create_app(allow_anonymous=True, home=site["home"], tracking_uri=f"sqlite:///{blocker}/mlflow.db",
                     mlflow_url=MLFLOW)
    client = TestClient(app)
    body = client.get(f"/runs/{COMPLETE}").text
    assert 'data-stage="compile" data-state="done"' in body and "speedup vs eager" in body
    assert "MLflow" in body.split('id="problems"')[1].split("</div></div>")[0]
    assert client.get("/").status_code == 200


@pytest.mark.parametrize("path,status", [
    ("/runs/%2E%2E", 400), ("/runs/a%2Fb", 404), ("/runs/%3Cscript%3E", 400), ("/runs/a%20b", 400),
    ("/runs/no_such_run", 404), ("/api/runs/%3Cscript%3E", 400),
])
def test_bad_run_keys_are_refused_without_reflecting_them(site, path, status):
    r = site["client"].get(path, headers={"accept": "text/html"})
    assert r.status_code == status
    _escaped_everywhere(r.text)


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
def test_the_page_is_read_only(site, method):
    r = site["client"].request(method, f"/runs/{COMPLETE}")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"


def test_security_headers_forbid_scripts_and_foreign_framing(site):
    r = site["client"].get("/")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp and "frame-ancestors 'self'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"


def test_every_route_depends_on_the_given_authentication(site):
    from fastapi import HTTPException

    def refuse():
        raise HTTPException(status_code=401, detail="Not authenticated")

    client = TestClient(create_app(auth=refuse, home=site["home"], tracking_uri=site["store"].tracking_uri))
    for path in ("/", f"/runs/{COMPLETE}", "/api/runs", f"/api/runs/{COMPLETE}"):
        r = client.get(path)
        assert r.status_code == 401 and COMPLETE not in r.text, path
    with pytest.raises(ValueError, match="authentication"):
        create_app()


@pytest.mark.parametrize("url", ["javascript:alert(1)", "ftp://x", "//evil", ""])
def test_mlflow_url_must_be_http(url):
    with pytest.raises(ValueError, match="RECFORGE_MLFLOW_URL"):
        mlflow_base(url)


def test_outputs_that_do_not_validate_are_reported_with_their_fields_and_shown_raw(tmp_path):
    ctx = RunContext.create("odd_shapes", {}, home=tmp_path)
    _write_raw(ctx, "generate", json.dumps({"files": 5, "bayes_auc": 3, "synthetic": True}))
    _write_raw(ctx, "evaluate", json.dumps({"auc": "high", "auc_ceiling": None}))
    _write_raw(ctx, "compile", json.dumps({"report": {"latency": "fast", "signature_groups": 5, "speedup": [2]}}))
    _write_raw(ctx, "publish", json.dumps({"model_name": ["x"], "version": {"v": 1}, "reason": EVIL}))
    blocker = tmp_path / "no_mlflow"
    blocker.write_text("")
    client = TestClient(create_app(allow_anonymous=True, home=tmp_path, mlflow_url=MLFLOW,
                                   tracking_uri=f"sqlite:///{blocker}/mlflow.db"))
    body = client.get("/runs/odd_shapes").text
    _escaped_everywhere(body)
    for stage in ("generate", "evaluate", "compile", "publish"):
        assert f'data-stage="{stage}" data-state="unreadable"' in body
        assert f"{stage}/outputs.json" in body  # what the stage recorded still shows, raw
    assert "generate: outputs.json does not hold GenerateOutputs: files: Input should be a valid list" in body
    assert "evaluate: outputs.json does not hold EvaluateOutputs: auc: Input should be a valid number" in body
    assert "logloss: Field required" in body and "report.latency: Input should be a valid dictionary" in body
    assert "publish: outputs.json does not hold PublishOutputs: model_name: Input should be a valid string" in body
    assert "No data recorded yet" in body and "Not evaluated yet" in body and "Not compiled yet" in body
    index = client.get("/")
    assert index.status_code == 200 and 'data-run-key="odd_shapes"' in index.text
    row = index.text.split('data-run-key="odd_shapes"')[1].split("</tr>")[0]
    assert 'data-state="failed"' in row and "failed at generate: its outputs are unreadable" in row


def _section(body: str, start: str, end: str) -> str:
    return body.split(start)[1].split(end)[0]


def _system(body: str, key: str) -> str:
    return _section(body, f'data-system="{key}"', '<div class="system"')


def test_corun_run_shows_every_system_the_gantt_the_fused_groups_and_the_curve(site):
    body = _html(site, f"/runs/{CORUN}")
    _escaped_everywhere(body)
    assert 'id="run-status" data-state="complete"' in body
    systems = dict(re.findall(r'data-system="(\w+)" data-state="([\w ]+)"', body))
    assert systems == {k: "used" for k in ("rap", "dlrover", "recom", "checkpoints", "executor", "warm_start",
                                           "gate")}
    rap = _system(body, "rap")
    for text in ("corun (requested: auto)", "co-run 15.5 ms &lt; inline 21.0 ms", "mapping imbalance before",
                 "0.42", "0.07", "measured iteration, co-run (ms)", "17.25"):
        assert text in rap, text
    dlrover = _system(body, "dlrover")
    for text in ("2 similar jobs: greedy search", "runtime: add_worker", "4,400", "5,200", "predicted / measured"):
        assert text in dlrover, text
    assert "512" in _system(body, "checkpoints") and "2.50 %" in _system(body, "checkpoints")
    assert "cpp_per_group" in _system(body, "executor") and "champion version 3" in _system(body, "warm_start")
    gate = _system(body, "gate")
    assert "0.72" in gate and "champion AUC, same held-out day (version 3)" in gate and "0.02" in gate
    # the planned Gantt from the co-run schedule file over the profiled stages: 5 stages + 3 kernels, the kernel
    # past emb_fwd's spare capacity marked; the as-run Gantt the train task recorded
    planned = _section(body, 'data-schedule="plan_resources"', "</svg>")
    assert planned.count("<rect") == 8 and "L1:sigrid_hash_sparsex26 [preprocess] 1.5–4 ms" in planned
    assert "not hidden" in _section(body, 'id="schedule"', 'id="resources"')
    assert _section(body, 'data-schedule="train"', "</svg>").count("<rect") == 1
    groups = _section(body, 'id="fused-groups"', "</table>")
    assert all(g in groups for g in GROUPS) and "emb_fwd (1.5 ms)" in groups and "mlp_bwd (1 ms)" in groups
    # the training curve: one point per step, the step logged twice counted once
    curve = _section(body, 'data-metric="train_loss"', "</svg>")
    points = re.search(r'<polyline points="([^"]+)"', curve).group(1).split()
    assert len(points) == len(LOSS) and "train loss" in curve
    assert 'data-metric="train_auc"' in body
    publish = _section(body, 'id="publish"', 'id="raw"')
    assert "challenger AUC" in publish and "0.72" in publish and "0.7" in publish
    evaluation = _section(body, 'id="evaluation"', 'id="compile"')
    assert "champion v3: AUC, same day" in evaluation


def test_inline_run_says_which_systems_it_did_not_use(site):
    body = _html(site, f"/runs/{INLINE}")
    systems = dict(re.findall(r'data-system="(\w+)" data-state="([\w ]+)"', body))
    assert systems["rap"] == systems["dlrover"] == systems["checkpoints"] == systems["warm_start"] == "not used"
    assert "co-run not used: the workers preprocessed inline" in _system(body, "rap")
    assert "resources.policy=static" in _system(body, "dlrover")
    assert "no champion yet" in _system(body, "gate")
    assert "No RAP schedule for this run" in body and 'data-schedule=' not in body
    assert "No per-step training metrics in MLflow" in body


def test_failed_run_page_shows_failed_with_the_error(site):
    body = _html(site, f"/runs/{FAILED}")
    status = _section(body, 'id="run-status"', "</div>")
    assert 'data-state="failed"' in status and f"failed at train: {TRAIN_ERROR}" in status
    train = _section(body, 'data-stage="train"', "</div>\n  </div>")
    assert 'data-state="failed"' in train and TRAIN_ERROR in train
    assert 'data-state="running"' not in body
    assert all(f'data-system="{k}" data-state="not run"' in body for k in ("checkpoints", "recom", "gate"))
    assert "not run: the run failed at train" in _system(body, "checkpoints")


def test_running_run_page_shows_running_and_the_curve_so_far(site):
    body = _html(site, f"/runs/{RUNNING}")
    assert 'id="run-status" data-state="running"' in body and "running: train" in body
    assert 'data-stage="train" data-state="running"' in body and 'data-state="failed"' not in body
    assert "curve is what its MLflow run logged so far" in body and 'data-metric="train_loss"' in body
    assert all(f'data-system="{k}" data-state="not yet"' in body for k in ("checkpoints", "recom", "gate"))


def test_summarize_reads_the_failure_from_mlflow_and_the_cli_prints_it(site, monkeypatch):
    from rich.console import Console
    from typer.testing import CliRunner

    from recforge import cli
    from recforge.cli import app

    ctx = RunContext.create(FAILED, {}, home=site["home"])
    s = summarize(ctx, MlflowView(site["store"].tracking_uri))
    assert s["status"]["state"] == "failed" and s["status"]["error"] == TRAIN_ERROR
    s = summarize(RunContext.create(CORUN, {}, home=site["home"]), MlflowView(site["store"].tracking_uri))
    assert dict(s["systems"]["rap"]["measured"])["measured iteration, co-run (ms)"] == 17.25
    assert s["systems"]["dlrover"]["decided"][1] == ("why", "2 similar jobs: greedy search")
    monkeypatch.setenv("RECFORGE_HOME", str(site["home"]))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # wide enough that no line wraps, whichever test imported recforge.cli (and built its console) first
    monkeypatch.setattr(cli, "console", Console(width=200))
    result = CliRunner().invoke(app, ["summary", FAILED])
    assert result.exit_code == 0, result.output
    assert f"failed at train: {TRAIN_ERROR}" in result.output
    assert "Checkpoints: not run: the run failed at train (not trained yet: train has no outputs)" in result.output
    assert "mapping imbalance before" in result.output
    result = CliRunner().invoke(app, ["summary", "no_such_run"])
    assert result.exit_code != 0 and "no pipeline run 'no_such_run'" in result.output
