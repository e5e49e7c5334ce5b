"""infra/: every Kubernetes manifest passes kubernetes-validate (offline, strict, the pinned schema version); the
Helm values for the official Airflow chart parse, set what recforge needs, and their embedded Kubernetes objects
(containers, volumes, resources) validate too; names shared between files agree; infra/jobs/ is what
recforge.elastic.backends.k8s_manifests generates."""
import re
from pathlib import Path

import pytest
import yaml

from recforge.elastic.backends import k8s_manifests

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
K8S_VERSION = "1.37.0"
VALUES = INFRA / "helm" / "airflow-values.yaml"
MANIFESTS = sorted(p for p in INFRA.rglob("*.yaml") if p != VALUES)


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _validate(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}: {e.message} "
                             f"at {'.'.join(map(str, e.path))}") from None


def _objects() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in _docs(p)}


def test_there_are_manifests_for_every_part():
    kinds = {kind for kind, _ in _objects()}
    assert {"Namespace", "PersistentVolumeClaim", "Deployment", "Service", "StatefulSet", "ServiceAccount",
            "Role", "RoleBinding", "Pod", "ConfigMap", "NetworkPolicy", "Job"} <= kinds, kinds


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(INFRA)))
def test_manifest_passes_strict_schema_validation(path):
    docs = _docs(path)
    assert docs, f"{path} holds no Kubernetes object"
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{path}: not a Kubernetes object"
        _validate(doc)


def test_validation_catches_a_broken_manifest():
    pod = _objects()[("Pod", "example-worker-0-l0")]
    broken = {**pod, "spec": {**pod["spec"], "containers": [{**pod["spec"]["containers"][0], "imagePullPolicy": 7}]}}
    with pytest.raises(AssertionError, match="imagePullPolicy"):
        _validate(broken)
    with pytest.raises(AssertionError):
        _validate({**pod, "spec": {**pod["spec"], "restartPolicyy": "Never"}})  # strict: unknown field


def _rules(role: dict) -> set[tuple[str, str]]:
    return {(res, verb) for r in role["rules"] for res in r["resources"] for verb in r["verbs"]}


def _api_calls(path: Path) -> set[tuple[str, str]]:
    """(resource, verb) of every CoreV1Api call in a module (a list call also watches: the same call streams)."""
    verbs = {"create": ["create"], "list": ["list", "watch"], "delete": ["delete"], "read": ["get"],
             "patch": ["patch"], "replace": ["update"]}
    out = set()
    for verb, kind in re.findall(r"\.(create|list|delete|read|patch|replace)_namespaced_(pod_log|pod|service|secret)\b",
                                 path.read_text()):
        resource = {"pod_log": "pods/log", "pod": "pods", "service": "services", "secret": "secrets"}[kind]
        out |= {(resource, v) for v in verbs[verb]}
    return out


def test_job_master_rbac_is_exactly_what_its_backend_calls():
    """Least privilege: the job master's Role grants the calls recforge.elastic.backends.kubernetes makes, no more
    (create_master_token_secret runs in the Airflow task, not in the master: no Secrets here)."""
    objs = _objects()
    backend = REPO / "platform" / "recforge" / "elastic" / "backends" / "kubernetes.py"
    calls = _api_calls(backend) - {("secrets", "create")}
    assert {("pods", "create"), ("pods", "watch"), ("services", "create"), ("pods/log", "get")} <= calls
    role = objs[("Role", "recforge-job-master")]
    assert _rules(role) == calls
    assert all(r["apiGroups"] == [""] for r in role["rules"])
    binding = objs[("RoleBinding", "recforge-job-master")]
    assert binding["roleRef"]["name"] == "recforge-job-master"
    assert {s["name"] for s in binding["subjects"]} == {"recforge-job-master"}
    assert ("ServiceAccount", "recforge-job-master") in objs
    assert objs[("Pod", "example-master")]["spec"]["serviceAccountName"] == "recforge-job-master"
    assert not any(r.get("resourceNames") is None and "*" in r["verbs"] + r["resources"] for r in role["rules"])


def test_airflow_task_pods_may_create_but_not_read_secrets():
    role = _objects()[("Role", "recforge-airflow-worker")]
    rules = _rules(role)
    assert ("secrets", "create") in rules and not {("secrets", v) for v in ("get", "list", "watch")} & rules
    # what the KubernetesPodOperator needs to run the job master pod, plus the token Secret's creation
    operator = REPO / "platform" / "recforge" / "pipelines" / "k8s_operator.py"
    assert {("pods", "create"), ("pods", "get"), ("pods", "watch"), ("pods", "delete"), ("pods/log", "get"),
            ("pods/exec", "create")} <= rules
    assert "create_master_token_secret" in operator.read_text()
    assert _values()["workers"]["serviceAccount"]["name"] == "recforge-airflow-worker"


def _values() -> dict:
    values = yaml.safe_load(VALUES.read_text())
    assert isinstance(values, dict)
    return values


def test_helm_values_set_what_recforge_needs():
    v = _values()
    assert v["executor"] == "KubernetesExecutor"
    assert v["airflowVersion"].startswith("3.")
    assert v["postgresql"]["enabled"] is False and v["data"]["metadataSecretName"]
    assert v["jwtSecretName"] and v["fernetKeySecretName"] and v["apiSecretKeySecretName"]
    assert v["images"]["airflow"]["repository"] == v["images"]["pod_template"]["repository"]
    core = v["config"]["core"]
    assert core["dags_folder"] == "/opt/recforge/dags" and core["plugins_folder"] == "/opt/recforge/plugins"
    env = {e["name"]: e["value"] for e in v["env"]}
    assert env["MLFLOW_TRACKING_URI"].startswith("http://recforge-mlflow")
    for component in ("scheduler", "dagProcessor", "apiServer", "workers", "triggerer"):
        assert component in v, component


def test_helm_values_reference_the_manifests_by_name():
    v, objs = _values(), _objects()
    assert ("ServiceAccount", v["workers"]["serviceAccount"]["name"]) in objs
    claims = {vol["persistentVolumeClaim"]["claimName"] for vol in v["volumes"] if "persistentVolumeClaim" in vol}
    assert claims and all(("PersistentVolumeClaim", c) in objs for c in claims)
    assert ("Service", v["env"][0]["value"].removeprefix("http://").split(":")[0]) in objs


def test_kubernetes_objects_inside_the_helm_values_validate():
    """The chart copies these fragments into its pods: check them as parts of a Pod against the same schema."""
    v = _values()
    api = v["apiServer"]
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "values-fragments"},
        "spec": {
            "initContainers": api["extraInitContainers"],
            "containers": [{"name": "airflow", "image": "recforge", "resources": v["workers"]["resources"],
                            "volumeMounts": v["volumeMounts"] + api["extraVolumeMounts"]}],
            "volumes": v["volumes"] + api["extraVolumes"],
        },
    }
    _validate(pod)
    mounted = {m["name"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"] for m in c["volumeMounts"]}
    assert mounted <= {vol["name"] for vol in pod["spec"]["volumes"]}


def test_job_templates_are_the_generated_manifests():
    """infra/jobs/*.yaml are written by `python -m recforge.elastic.backends.k8s_manifests infra/jobs`: the pod shape
    lives in one place, and a change to it that was not regenerated fails here."""
    jobs = INFRA / "jobs"
    generated = k8s_manifests.templates()
    assert sorted(p.name for p in jobs.glob("*.yaml")) == sorted(generated)
    for name, text in generated.items():
        assert (jobs / name).read_text() == text, f"infra/jobs/{name} is stale: regenerate it"
    for name, manifest in k8s_manifests.example_manifests().items():
        assert yaml.safe_load(generated[name]) == manifest, name
