"""The pod the recforge_train_k8s DAG's operator creates is k8s_manifests.master_pod (the pod infra/jobs is generated
from) for the run's Params: built offline by the operator itself, after Jinja rendering. The image comes from the
deployment's allow-list (RECFORGE_K8S_IMAGES), the namespace from the deployment; another image is refused when the
pod request is built (before any pod exists), naming it; the pod mounts its own token Secret."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recforge.elastic.backends.k8s_manifests import (
    JOB_LABEL,
    MASTER_APP,
    TOKEN_FILE,
    JobPodSettings,
    master_pod,
    token_secret_name,
    validate,
)
from recforge.elastic.backends.kubernetes import backend_from_environment, memory_bytes

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "ml-team"
IMAGES = ["registry.example.com/recforge:0.1.0", "registry.example.com/recforge:0.2.0-cuda"]
DEFAULTS = {"job_json": "/var/lib/recforge/runs/train/job.json", "image": IMAGES[0], "worker_memory": "16Gi",
            "worker_gpus": 0}
CUSTOM = {"job_json": "/var/lib/recforge/runs/nightly/job.json", "image": IMAGES[1], "worker_memory": "48Gi",
          "worker_gpus": 2}
# trigger conf is merged into the Params unchecked: the operator must refuse these itself
REFUSED = [{"image": "docker.io/attacker/miner:latest"}, {"image": IMAGES[0] + " "}]

# Load the DAG file, render its one task for each Params override (as a run's context would) and let the operator
# build the pod it would create (dry run: no cluster, no task-instance labels). Airflow stays in a subprocess with
# a home of its own, like the other Airflow tests.
BUILD = """
import importlib.util, json, sys
from kubernetes.client import ApiClient
spec = importlib.util.spec_from_file_location("recforge_train_k8s", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pods = []
for overrides in json.loads(sys.argv[2]):
    dag = module.recforge_train_k8s()  # a fresh DAG per run: rendering writes into the task
    (task,) = dag.tasks
    params = {**{k: dag.params[k] for k in dag.params}, **overrides}
    task.render_template_fields({"params": params}, jinja_env=dag.get_template_env())
    try:
        pod = task.build_pod_request_obj(dry_run=True)
    except Exception as e:
        pods.append({"params": params, "error": f"{type(e).__name__}: {e}"})
        continue
    pods.append({"params": params, "pod": ApiClient().sanitize_for_serialization(pod),
                 "timeout_s": task.execution_timeout.total_seconds(),
                 "param_enum": dag.params.get_param("image").schema.get("enum")})
print(json.dumps(pods))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    home = tmp_path_factory.mktemp("af")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False", RECFORGE_HOME=str(home / "home"),
               RECFORGE_K8S_NAMESPACE=NAMESPACE, RECFORGE_K8S_IMAGES=",".join(IMAGES),
               RECFORGE_K8S_JOB_TIMEOUT_S="7200")
    out = subprocess.run([sys.executable, "-c", BUILD, str(REPO / "dags" / "recforge_train_k8s.py"),
                          json.dumps([{}, CUSTOM, *REFUSED])], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _expected(params: dict, pod_name: str) -> dict:
    """master_pod for these Params, written here independently of recforge.pipelines.k8s_job."""
    settings = JobPodSettings(namespace=NAMESPACE, job_id="unknown", image=params["image"], extra_env={
        "RECFORGE_WORKER_MEMORY": params["worker_memory"], "RECFORGE_WORKER_GPUS": str(params["worker_gpus"]),
        "MLFLOW_TRACKING_URI": "http://recforge-mlflow:5000",
    }, token_secret=token_secret_name(pod_name), mlflow_secret="recforge-mlflow-pipeline")
    return master_pod(settings, job_json=params["job_json"])


def _without_operator_additions(pod: dict) -> dict:
    """The pod less what KubernetesPodOperator adds to every pod: the XCom sidecar and its volume, its own labels,
    a unique name suffix, Kubernetes defaults (terminationMessagePolicy File, hostNetwork false) and empty fields."""
    def pruned(d: dict) -> dict:
        return {k: v for k, v in d.items() if v not in (None, [], {}, False)}

    spec = pruned(pod["spec"])
    names = [c["name"] for c in spec["containers"]]
    assert names == ["master", "airflow-xcom-sidecar"], names
    container = pruned(spec["containers"][0])
    assert container.pop("terminationMessagePolicy") == "File"
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "xcom"]
    spec["containers"] = [container]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "xcom"]
    meta = dict(pod["metadata"])
    assert meta.pop("name").startswith(f"{MASTER_APP}-")
    meta["labels"] = {k: v for k, v in meta["labels"].items() if k != "airflow_version"}
    return {**pod, "metadata": pruned(meta), "spec": spec}


@pytest.mark.parametrize("run", [0, 1], ids=["default-params", "custom-params"])
def test_the_dag_runs_master_pod_for_its_params(built, run):
    params, pod = built[run]["params"], built[run]["pod"]
    assert params == {**DEFAULTS, **(CUSTOM if run else {})}
    assert built[run]["param_enum"] == IMAGES and built[run]["timeout_s"] == 7200
    expected = _expected(params, pod["metadata"]["name"])
    got = _without_operator_additions(pod)
    # the job id is the master's to derive (from JOB_JSON's state directory): no job label on the DAG's pod
    exp_meta = expected["metadata"]
    assert got["metadata"] == {"namespace": exp_meta["namespace"],
                               "labels": {k: v for k, v in exp_meta["labels"].items() if k != JOB_LABEL}}
    (container,) = got["spec"]["containers"]
    (exp_container,) = expected["spec"]["containers"]
    for key in ("image", "args", "env", "ports", "resources", "volumeMounts", "imagePullPolicy", "name"):
        assert container.get(key) == exp_container.get(key), key
    assert container == exp_container
    assert got["spec"] == expected["spec"]
    validate(pod)  # the rendered pod, sidecar included, is a valid Pod (e.g. no integer env values)


def test_the_params_reach_the_masters_backend(built, tmp_path, monkeypatch):
    """The worker image, memory and GPUs a run asks for are what the master's backend reads from its pod."""
    params, pod = built[1]["params"], built[1]["pod"]
    for e in pod["spec"]["containers"][0]["env"]:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    monkeypatch.setenv("POD_NAMESPACE", pod["metadata"]["namespace"])  # a fieldRef, set by the kubelet
    backend = backend_from_environment(tmp_path / "runs" / "r" / "state")
    assert (backend.settings.image, backend.settings.namespace, memory_bytes(backend.memory), backend.gpus_per_worker) \
        == (params["image"], NAMESPACE, memory_bytes(params["worker_memory"]), params["worker_gpus"])
    # the pod's own token Secret (named for its final, suffixed name) reaches the backend, which mounts it in workers
    secret = token_secret_name(pod["metadata"]["name"])
    assert backend.settings.token_secret == secret and backend.settings.mlflow_secret == "recforge-mlflow-pipeline"
    (volume,) = [v for v in pod["spec"]["volumes"] if v.get("secret")]
    assert volume["secret"]["secretName"] == secret
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["RECFORGE_MASTER_TOKEN_FILE"]["value"] == TOKEN_FILE
    assert not any("token" in str(e.get("value", "")).lower() and e["name"] not in (
        "RECFORGE_MASTER_TOKEN_FILE", "RECFORGE_MASTER_TOKEN_SECRET") for e in env.values())


@pytest.mark.parametrize("run", [2, 3], ids=["foreign-image", "almost-the-image"])
def test_an_image_outside_the_allow_list_is_refused_before_a_pod_exists(built, run):
    """build_pod_request_obj runs before the operator creates anything; the error names the image, and
    AirflowFailException means no retry."""
    err = built[run].get("error")
    assert err is not None and "pod" not in built[run]
    assert err.startswith("AirflowFailException: refused to start the job master pod: image ")
    assert repr(built[run]["params"]["image"]) in err and "RECFORGE_K8S_IMAGES" in err


def test_deployment_settings_from_the_environment():
    from recforge.config.deployment import ImageNotAllowed, K8sDeployment

    d = K8sDeployment.from_env({"RECFORGE_K8S_NAMESPACE": "ml", "RECFORGE_K8S_IMAGES": f" {IMAGES[1]}, {IMAGES[0]} ",
                                "RECFORGE_K8S_MLFLOW_SECRET": "", "RECFORGE_K8S_JOB_TIMEOUT_S": "60"})
    assert (d.namespace, d.images, d.default_image, d.mlflow_secret, d.job_timeout_s) == (
        "ml", [IMAGES[1], IMAGES[0]], IMAGES[1], None, 60.0)
    assert K8sDeployment.from_env({}).images == ["registry.example.com/recforge:0.1.0"]
    assert d.check_image(IMAGES[0]) == IMAGES[0]
    with pytest.raises(ImageNotAllowed, match=r"image 'busybox' is not allow-listed .*RECFORGE_K8S_IMAGES"):
        d.check_image("busybox")
    for env, match in [({"RECFORGE_K8S_NAMESPACE": "Not_A_Label"}, "DNS-1123"),
                       ({"RECFORGE_K8S_IMAGES": "ok/image:1,{{ params.image }}"}, "not image references"),
                       ({"RECFORGE_K8S_IMAGES": "a/b:1,a/b:1"}, "listed twice"),
                       ({"RECFORGE_K8S_JOB_TIMEOUT_S": "0"}, "job_timeout_s")]:
        with pytest.raises(ValueError, match=match):
            K8sDeployment.from_env(env)
