"""End to end against live services (scripts/services.sh up): trigger recforge_daily through Airflow's REST API
with changed Params, wait for success, then check through MLflow's REST API that the pipeline's runs, the
registered model version and its alias exist and match the Params. Also: authentication is required
everywhere (the RecForge page included), and invalid Params are refused naming the field. A backfill over two
landed days runs each day once, and a cleared day re-runs in place."""
import json
import subprocess
import sys
import time
import uuid
from datetime import date
from pathlib import Path

import httpx
import jwt
import pytest

from e2e_services import DAG_ID, REPO, TINY
from recforge.pipelines.context import run_key_from
from recforge.pipelines.landing import land_synthetic
from recforge.pipelines.outputs import STAGE_OUTPUTS

pytestmark = pytest.mark.slow

STAGES = ["generate", "ingest", "plan_resources", "train", "evaluate", "compile", "publish"]


def test_everything_needs_an_airflow_login(live):
    for path in ("/api/v2/dags", "/recforge/", "/recforge/api/runs", "/recforge/runs/anything"):
        r = httpx.get(live.airflow_url + path, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text[:300])
        r = httpx.get(live.airflow_url + path, headers={"Authorization": "Bearer not-a-jwt"}, timeout=30)
        assert r.status_code in (401, 403), (path, r.status_code)
        r = httpx.get(live.airflow_url + path, cookies={"_token": "not-a-jwt"}, timeout=30)
        assert r.status_code in (401, 403), (path, r.status_code)
    page = live.api("GET", "/recforge/")
    assert page.status_code == 200 and "RecForge" in page.text
    assert "script-src" not in page.headers["content-security-policy"]
    # a token signed with another secret is refused, one from this install's /auth/token is accepted
    forged = jwt.encode({"sub": "admin", "role": "admin", "aud": "apache-airflow"}, "x" * 64, algorithm="HS512")
    assert httpx.get(live.airflow_url + "/recforge/", headers={"Authorization": f"Bearer {forged}"},
                     timeout=30).status_code == 403


def test_the_plugin_is_registered_with_a_nav_entry(live):
    plugins = {p["name"]: p for p in live.api("GET", "/api/v2/plugins").json()["plugins"]}
    assert "recforge" in plugins, plugins
    assert [a["url_prefix"] for a in plugins["recforge"]["fastapi_apps"]] == ["/recforge"]
    view = plugins["recforge"]["external_views"][0]
    assert view["href"] == "recforge/" and view["destination"] == "nav" and view["url_route"] == "recforge"
    errors = live.api("GET", "/api/v2/importErrors").json()
    assert errors["total_entries"] == 0, errors


@pytest.mark.parametrize("conf,field", [
    ({"rows_per_day": 5}, "rows_per_day"),
    ({"workers": "many"}, "workers"),
    ({"model_arch": "transformer"}, "model_arch"),
    ({"table_cap": 0}, "table_cap"),
])
def test_invalid_params_are_refused_naming_the_field(live, conf, field):
    run_id = f"e2e_invalid_{uuid.uuid4().hex[:8]}"
    r = live.trigger(run_id, {**TINY, **conf})
    assert r.status_code == 400, r.text
    assert f"param {field}" in r.json()["detail"], r.text
    assert live.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}").status_code == 404


def test_triggered_run_is_tracked_registered_and_aliased_in_mlflow(live):
    """Checks a whole run on the default product path: the browser test's UI-triggered run when it ran in this
    session (one DAG run less: the suite's time), else one triggered here through the REST API."""
    ui_runs = [r for r in live.succeeded.values() if r["dag_run_id"].startswith("e2e_browser_")]
    if ui_runs:
        run_id, conf = ui_runs[0]["dag_run_id"], ui_runs[0]["conf"]
    else:
        run_id, conf = f"e2e_api_{uuid.uuid4().hex[:8]}", {**TINY, "seed": int(time.time()) % 100_000}
        r = live.trigger(run_id, conf)
        assert r.status_code == 200, r.text
        assert r.json()["conf"] == conf
        live.wait_for_run(run_id)
    key = run_key_from(run_id)

    exp = live.mlflow("GET", "experiments/get-by-name", params={"experiment_name": DAG_ID})["experiment"]
    runs = live.mlflow("POST", "runs/search", json={
        "experiment_ids": [exp["experiment_id"]], "filter": f"tags.`recforge.run_key` = '{key}'",
        "max_results": 50})["runs"]
    by_stage = {}
    for run in runs:
        tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
        by_stage[tags["recforge.stage"]] = (run, tags)
    assert sorted(by_stage) == sorted(STAGES + ["pipeline"])
    parent, _ = by_stage["pipeline"]
    params = {p["key"]: p["value"] for p in parent["data"]["params"]}
    assert params["rows_per_day"] == str(conf["rows_per_day"]) and params["seed"] == str(conf["seed"])
    assert params["table_cap"] == str(conf["table_cap"]) and params["train.batch_size"] == str(conf["batch_size"])
    assert params["resources.workers"] == str(conf["workers"])
    # the defaults the trigger left alone are the product's: RAP auto, DLRover-RM, checkpoints on
    assert params["preprocessing"] == "auto" and params["resources.policy"] == "dlrover"
    assert int(params["checkpoint.every_steps"]) > 0
    assert parent["info"]["status"] == "FINISHED"
    for stage in STAGES:
        run, tags = by_stage[stage]
        assert run["info"]["status"] == "FINISHED", stage
        assert tags["mlflow.parentRunId"] == parent["info"]["run_id"], stage
    metrics = {m["key"]: m["value"] for m in by_stage["evaluate"][0]["data"]["metrics"]}
    assert 0.5 < metrics["auc"] <= metrics["auc_ceiling"] + 0.02
    # the workers logged windowed training quality every log_every steps
    train_metrics = {m["key"] for m in by_stage["train"][0]["data"]["metrics"]}
    assert {"train_auc", "train_logloss", "train_ne", "train_loss", "samples_per_s"} <= train_metrics
    # every stage recorded outputs that read back as its typed model
    run_dir = live.home / "runs" / DAG_ID / key
    for stage, model in STAGE_OUTPUTS.items():
        model.model_validate_json((run_dir / stage / "outputs.json").read_text())

    publish_run = by_stage["publish"][0]["info"]["run_id"]
    versions = live.mlflow("GET", "model-versions/search", params={
        "filter": f"name='recforge-dlrm' and run_id='{publish_run}'"})["model_versions"]
    assert len(versions) == 1, versions
    version = versions[0]
    vtags = {t["key"]: t["value"] for t in version.get("tags", [])}
    assert vtags["run_key"] == key and abs(float(vtags["auc"]) - metrics["auc"]) < 1e-5
    champion = live.mlflow("GET", "registered-models/alias", params={"name": "recforge-dlrm", "alias": "champion"})
    parent_tags = by_stage["pipeline"][1]
    assert parent_tags["model_version"] == version["version"]
    if parent_tags["champion"] == "True":
        assert champion["model_version"]["version"] == version["version"]
    else:  # not promoted: the alias stays on an earlier version, and the reason is on this one
        assert champion["model_version"]["version"] != version["version"] and "margin" in vtags["promotion"]

    # the RecForge page shows the same run, complete, linked to the same MLflow runs and model version
    page = live.api("GET", f"/recforge/api/runs/{key}").json()
    assert [s["state"] for s in page["stages"]] == ["done"] * 7
    assert publish_run in next(s["url"] for s in page["stages"] if s["name"] == "publish")
    assert page["publish"]["url"].endswith(f"/#/models/recforge-dlrm/versions/{version['version']}")
    assert page["publish"]["url"].startswith(live.mlflow_url)


def test_the_triggerer_runs(live):
    """make up runs the triggerer (recforge_daily's wait_for_data defers to it): healthy, not red on the home page."""
    health = live.api("GET", "/api/v2/monitor/health").json()
    assert health["triggerer"]["status"] == "healthy", health


def _airflow_cli(live, *args: str) -> subprocess.CompletedProcess:
    """The `airflow` CLI as the README runs it (`. scripts/env.sh && airflow ...`) against the live services."""
    script = '. scripts/env.sh && exec "$RECFORGE_VENV_BIN/airflow" "$@"'
    return subprocess.run(["bash", "-c", script, "airflow", *args],
                          env={**live.env, "RECFORGE_VENV_BIN": str(Path(sys.executable).parent)}, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_a_backfill_runs_each_day_once_and_a_cleared_day_reruns_in_place(live):
    """`airflow backfill create` over two days: one DAG run per day, each succeeds; the second day's file lands only
    once its wait_for_data is deferred to the triggerer (which then sees it); clearing one day's data tasks re-runs
    them in place (same MLflow runs, outputs replaced, not duplicated); a second backfill over the range adds no
    run."""
    days = [date(2026, 1, 5), date(2026, 1, 6)]
    land_synthetic(live.home / "landing", days[0], 1, rows_per_day=TINY["rows_per_day"])
    # sensor_poke_s 1: the second day's file (written via temp + rename) is seen and counted landed within ~2 s
    conf = {**TINY, "workers": 1, "resources_policy": "static", "preprocessing": "inline", "holdout": "split",
            "sensor_poke_s": 1}
    backfill = ["backfill", "create", "--dag-id", DAG_ID, "--from-date", days[0].isoformat(), "--to-date",
                days[-1].isoformat(), "--max-active-runs", "1", "--dag-run-conf", json.dumps(conf)]
    t0 = time.monotonic()
    out = _airflow_cli(live, *backfill)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    def backfill_runs() -> list[dict]:
        return [r for r in live.runs() if r["run_type"] == "backfill"]

    runs = backfill_runs()
    assert sorted(r["logical_date"][:10] for r in runs) == [d.isoformat() for d in days], runs
    live.owned.update(r["dag_run_id"] for r in runs)
    runs.sort(key=lambda r: r["logical_date"])
    live.wait_for_run(runs[0]["dag_run_id"], timeout=900)
    sensor = f"/api/v2/dags/{DAG_ID}/dagRuns/{runs[1]['dag_run_id']}/taskInstances/wait_for_data"
    deadline = time.monotonic() + 300
    while (state := live.api("GET", sensor).json().get("state")) != "deferred":
        assert state in (None, "scheduled", "queued", "running") and time.monotonic() < deadline, \
            f"wait_for_data of the second day is {state}, not deferred\n{live.describe(runs[1]['dag_run_id'])}"
        time.sleep(0.5)  # one task instance's GET: the file lands as soon as the sensor has deferred
    land_synthetic(live.home / "landing", days[1], 1, rows_per_day=TINY["rows_per_day"])  # the triggerer sees it
    live.wait_for_run(runs[1]["dag_run_id"], timeout=900)
    print(f"backfill of {len(days)} days: {time.monotonic() - t0:.0f} s")
    # each day once: one DAG run and one MLflow pipeline run per day
    exp = live.mlflow("GET", "experiments/get-by-name", params={"experiment_name": DAG_ID})["experiment"]

    def stage_runs(key: str) -> dict[str, list[str]]:
        found = live.mlflow("POST", "runs/search", json={
            "experiment_ids": [exp["experiment_id"]], "filter": f"tags.`recforge.run_key` = '{key}'",
            "max_results": 100})["runs"]
        by_stage: dict[str, list[str]] = {}
        for r in found:
            tags = {t["key"]: t["value"] for t in r["data"].get("tags", [])}
            by_stage.setdefault(tags["recforge.stage"], []).append(r["info"]["run_id"])
        return by_stage

    first = runs[0]
    key = run_key_from(first["dag_run_id"])
    before = stage_runs(key)
    assert sorted(before) == sorted(STAGES + ["pipeline"]) and all(len(v) == 1 for v in before.values()), before
    run_dir = live.home / "runs" / DAG_ID / key
    gen = json.loads((run_dir / "generate" / "outputs.json").read_text())
    assert gen["synthetic"] is False and gen["run_day"] == first["logical_date"][:10] and gen["holdout"] == "split"
    ingest_before = json.loads((run_dir / "ingest" / "outputs.json").read_text())

    # re-run the day's data tasks: replaced in place
    r = live.api("POST", f"/api/v2/dags/{DAG_ID}/clearTaskInstances", json={
        "dag_run_id": first["dag_run_id"], "task_ids": ["wait_for_data", "generate", "ingest"],
        "include_downstream": False, "include_upstream": False, "only_failed": False, "reset_dag_runs": True,
        "dry_run": False})
    assert r.status_code == 200, r.text
    tries = {}
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        tis = live.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{first['dag_run_id']}/taskInstances").json()
        tries = {t["task_id"]: (t["try_number"], t["state"]) for t in tis["task_instances"]}
        if tries["ingest"][0] > 1 and tries["ingest"][1] == "success":
            break
        assert tries["ingest"][1] not in ("failed", "upstream_failed"), live.describe(first["dag_run_id"])
        time.sleep(1)
    assert tries["ingest"][0] > 1 and tries["ingest"][1] == "success", tries
    live.wait_for_run(first["dag_run_id"], timeout=300)
    after = stage_runs(key)
    assert after == before  # the same MLflow runs, reused; none added
    ingest_after = json.loads((run_dir / "ingest" / "outputs.json").read_text())
    assert {k: ingest_after[k] for k in ("train", "holdout", "rows_ingested", "mlflow_run_id")} == \
        {k: ingest_before[k] for k in ("train", "holdout", "rows_ingested", "mlflow_run_id")}
    train_dir = Path(ingest_after["train"]["manifest_dir"])
    assert len(list(train_dir.glob("part-*.parquet"))) == ingest_after["train"]["shards"]
    leftovers = [p for p in run_dir.iterdir() if p.name.startswith(".")]  # a stage's .<stage>.tmp-<pid>
    leftovers += [p for stage in ("generate", "ingest") for p in (run_dir / stage).rglob(".*")]
    assert not leftovers, f"temp files left behind: {leftovers}"

    # again over the range: no new run. One active backfill per DAG: the scheduler marks the first one complete only
    # on a 30 s timer (Airflow's _mark_backfills_complete), so this comes after the re-run above, which that wait
    # overlapped (it took ~15 s on average when it came first)
    deadline = time.monotonic() + 180
    while any(b["completed_at"] is None for b in live.api("GET", "/api/v2/backfills",
                                                          params={"dag_id": DAG_ID}).json()["backfills"]):
        assert time.monotonic() < deadline, "the scheduler did not mark the backfill complete within 180 s"
        time.sleep(0.5)
    again = _airflow_cli(live, *backfill)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert sorted(r["dag_run_id"] for r in backfill_runs()) == sorted(r["dag_run_id"] for r in runs)
    assert stage_runs(key) == before  # nor a new MLflow run
