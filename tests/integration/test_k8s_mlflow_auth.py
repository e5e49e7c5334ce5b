"""infra/mlflow's authentication, for real: `mlflow server --app-name basic-auth` (as infra/mlflow/deployment.yaml
runs it: default_permission READ, admin from the environment) on loopback with a SQLite store, then the permissions
script of infra/mlflow/auth-setup.yaml (its ConfigMap, verbatim). Afterwards the pipeline's user can write the
registered model recforge-dlrm, another user cannot, and no request without credentials gets through."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "infra" / "mlflow" / "auth-setup.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow-auth")
    port = _free_port()
    (tmp / "basic_auth.ini").write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{tmp / 'auth.db'}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW")}
    env.update(MLFLOW_AUTH_CONFIG_PATH=str(tmp / "basic_auth.ini"), MLFLOW_AUTH_ADMIN_USERNAME="admin",
               MLFLOW_AUTH_ADMIN_PASSWORD="admin-pw-for-this-test", MLFLOW_FLASK_SERVER_SECRET_KEY="test-key",
               MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth", "--host",
                             "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                             "--default-artifact-root", str(tmp / "artifacts")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow basic-auth server did not answer /health within 180 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _client_env(url: str, user: str | None, password: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW")}
    env.update(MLFLOW_TRACKING_URI=url, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="30")
    if user:
        env.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password or "")
    return env


SETUP_DONE = "--- setup done ---"
# as the admin: another user; then each user tries to write the registered model (credentials are read per request)
PROBE = """
import json, os
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.server.auth.client import AuthServiceClient
AuthServiceClient(os.environ["MLFLOW_TRACKING_URI"]).create_user("analyst", "analyst-pw-for-this-test")
out = {}
for user, password in json.loads(os.environ["PROBE_USERS"]):
    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = user, password
    try:
        MlflowClient().set_registered_model_tag("recforge-dlrm", "written_by", user)
        out[f"{user}:{password}"] = "WROTE"
    except MlflowException as e:
        out[f"{user}:{password}"] = e.error_code
print(json.dumps(out))
"""


def test_only_the_pipeline_user_writes_the_registered_model(server):
    import json

    (config_map, job) = [d for d in yaml.safe_load_all(SETUP.read_text()) if d]
    script = config_map["data"]["mlflow_auth_setup.py"]
    env = _client_env(server, "admin", "admin-pw-for-this-test")
    env.update(PIPELINE_USERNAME="recforge-pipeline", PIPELINE_PASSWORD="pipeline-pw-for-this-test")
    users = [("recforge-pipeline", "pipeline-pw-for-this-test"), ("analyst", "analyst-pw-for-this-test"),
             ("recforge-pipeline", "wrong-password")]
    env["PROBE_USERS"] = json.dumps(users)
    # twice in one process: the Job is idempotent (a retry, a password rotation); then the probe in that same process
    # (the admin's credentials still in its environment: one MLflow import, not two)
    twice = f"script = {script!r}\n" + "exec(compile(script, 'setup', 'exec'), {})\n" * 2
    out = subprocess.run([sys.executable, "-c", twice + f"print({SETUP_DONE!r})\n" + PROBE], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    setup_out, probe_out = out.stdout.split(SETUP_DONE + "\n")
    assert "created user recforge-pipeline" in setup_out and "password reset" in setup_out
    assert setup_out.count("MANAGE on registered model recforge-dlrm") == 2
    # the Job runs that very script with the same variables
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["python", "/setup/mlflow_auth_setup.py"]
    assert {"MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "PIPELINE_USERNAME",
            "PIPELINE_PASSWORD"} <= {e["name"] for e in c["env"]}

    got = json.loads(probe_out.strip().splitlines()[-1])
    assert got["recforge-pipeline:pipeline-pw-for-this-test"] == "WROTE"
    assert got["analyst:analyst-pw-for-this-test"] == "PERMISSION_DENIED"
    assert got["recforge-pipeline:wrong-password"] not in ("WROTE", None)
    # no credentials: 401 on the API (only /health is open)
    req = urllib.request.Request(f"{server}/api/2.0/mlflow/registered-models/get?name=recforge-dlrm")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401
