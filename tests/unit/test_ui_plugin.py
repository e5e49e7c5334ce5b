"""plugins/recforge_plugin.py as Airflow's plugin manager loads it: no import errors, the FastAPI app under
/recforge, a navigation entry, and a cheap import (task processes load plugins too)."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CODE = """
import json, sys
from airflow import plugins_manager
info = plugins_manager.get_plugin_info()
apps, _ = plugins_manager.get_fastapi_plugins()
print(json.dumps({
    "errors": plugins_manager.get_import_errors(),
    "plugins": [p["name"] for p in info],
    "apps": [{"prefix": a["url_prefix"], "name": a["name"], "type": type(a["app"]).__name__} for a in apps],
    "views": [v for p in info for v in p.get("external_views", [])],
    "heavy": sorted(m for m in ("fastapi.applications", "mlflow", "torch", "airflow.api_fastapi.core_api.security")
                    if m in sys.modules),
}))
"""


def test_airflow_loads_the_plugin_with_its_app_and_nav_entry(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW"))}
    env.update(AIRFLOW_HOME=str(tmp_path), AIRFLOW__CORE__PLUGINS_FOLDER=str(REPO / "plugins"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False", RECFORGE_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["errors"] == {}
    assert info["plugins"] == ["recforge"]
    assert info["apps"] == [{"prefix": "/recforge", "name": "RecForge", "type": "LazyApp"}]
    assert info["views"] == [{"name": "RecForge", "href": "recforge/", "url_route": "recforge",
                              "destination": "nav", "nav_top_level": True}]
    assert info["heavy"] == [], "loading the plugin must not build the app (task processes load plugins too)"


LAZY = """
import json, sys
from fastapi.testclient import TestClient
from airflow.api_fastapi.app import init_auth_manager
from recforge.ui.airflow_app import LazyApp
init_auth_manager()  # what the api-server does at start (SimpleAuthManager here)
app = LazyApp()
client = TestClient(app)
out = {}
for path in ("/", "/api/runs", "/runs/x"):
    r = client.get(path)
    out[path] = [r.status_code, r.json().get("detail")]
r = client.get("/", headers={"Authorization": "Bearer not-a-jwt"})
out["bad token"] = [r.status_code, r.json().get("detail")]
out["built"] = type(app._app).__name__
print(json.dumps(out))
"""


def test_the_mounted_app_requires_airflow_authentication(tmp_path):
    """The app the plugin mounts, built on first request, refuses callers without a valid Airflow JWT."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW"))}
    env.update(AIRFLOW_HOME=str(tmp_path), RECFORGE_HOME=str(tmp_path / "home"),
               AIRFLOW__API_AUTH__JWT_SECRET="x" * 128)
    out = subprocess.run([sys.executable, "-c", LAZY], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info.pop("built") == "FastAPI"
    assert info == {"/": [401, "Not authenticated"], "/api/runs": [401, "Not authenticated"],
                    "/runs/x": [401, "Not authenticated"], "bad token": [403, "Invalid JWT token"]}
