"""End to end against live services (scripts/services.sh up): trigger recforge_daily through Airflow's REST API
with changed Params, wait for success, then check through MLflow's REST API that the pipeline's runs, the
registered model version and its alias exist and match the Params. Also: authentication is required
everywhere (the RecForge page included), and invalid Params are refused naming the field."""
import time
import uuid

import httpx
import jwt
import pytest

from e2e_services import DAG_ID, TINY
from recforge.pipelines.context import run_key_from
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
