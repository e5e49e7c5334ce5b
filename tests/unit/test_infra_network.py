"""infra/network/policies.yaml against the pods the platform actually creates: each policy's selectors select (and
only select) the pods they are meant for, by the labels k8s_manifests / the DAG's operator / infra/ give those pods,
and the ports they admit are the ports those pods serve. Selection is evaluated here as Kubernetes does
(matchLabels and matchExpressions, AND-ed; ingress `from` entries OR-ed)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from recforge.elastic.backends.k8s_manifests import (
    MASTER_PORT,
    RDZV_PORT,
    JobPodSettings,
    PodResources,
    master_pod,
    rendezvous_service,
    worker_pod,
)
from recforge.pipelines.k8s_job import job_master_pod

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
S = JobPodSettings(namespace="recforge", job_id="job-1", image="registry.example.com/recforge:0.1.0",
                   token_secret="job-1-master-token")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


POLICIES = {d["metadata"]["name"]: d for d in _docs(INFRA / "network" / "policies.yaml")}


def _template_labels(path: Path, kind: str) -> dict[str, str]:
    (d,) = [d for d in _docs(path) if d["kind"] == kind]
    return d["spec"]["template"]["metadata"]["labels"]


def _dag_master_labels() -> dict[str, str]:
    """The DAG's master pod: job_master_pod's labels plus what KubernetesPodOperator adds to every pod."""
    pod = job_master_pod(namespace="recforge", image="x", job_json="/j", worker_memory="1Gi", worker_gpus="0")
    return {**pod["metadata"]["labels"], "dag_id": "recforge_train_k8s", "task_id": "job_master",
            "kubernetes_pod_operator": "True", "try_number": "1"}


PODS = {
    "master": master_pod(S, job_json="/j")["metadata"]["labels"],
    "dag-master": _dag_master_labels(),
    "worker": worker_pod(S, index=0, workers=2, generation=0, spec_path="/s", resources=PodResources(1, "1Gi"),
                         threads=1)["metadata"]["labels"],
    "worker-1": worker_pod(S, index=1, workers=2, generation=3, spec_path="/s", resources=PodResources(1, "1Gi"),
                           threads=1)["metadata"]["labels"],
    "mlflow": _template_labels(INFRA / "mlflow" / "deployment.yaml", "Deployment"),
    "postgres": _template_labels(INFRA / "mlflow" / "postgres.yaml", "StatefulSet"),
    "mlflow-auth-setup": _template_labels(INFRA / "mlflow" / "auth-setup.yaml", "Job"),
    # the official Airflow chart's pods (its templates label every component so)
    "airflow-task": {"tier": "airflow", "component": "worker", "release": "airflow"},
    "airflow-api-server": {"tier": "airflow", "component": "api-server", "release": "airflow"},
    "airflow-scheduler": {"tier": "airflow", "component": "scheduler", "release": "airflow"},
    "stranger": {"app": "something-else"},
}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        k, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in values or op == "NotIn" and k in labels and labels[k] in values:
            return False
        if op == "Exists" and k not in labels or op == "DoesNotExist" and k in labels:
            return False
    return True


def admitted(target: str, port: int) -> set[str]:
    """The pods that may open `port` on pod `target`: the union over the policies that select it."""
    out: set[str] = set()
    for policy in POLICIES.values():
        if not selects(policy["spec"]["podSelector"], PODS[target]):
            continue
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports is not None and not any(p.get("port") in (port, None) for p in ports):
                continue
            for peer in rule.get("from") or []:
                assert set(peer) == {"podSelector"}, "only pods of this namespace are admitted"
                out |= {name for name, labels in PODS.items() if selects(peer["podSelector"], labels)}
    return out


def test_the_selector_matcher_is_kubernetes_semantics():
    assert selects({}, {"a": "1"}) and selects({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"})
    assert not selects({"matchLabels": {"a": "1"}}, {"a": "2"})
    assert selects({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"})
    assert not selects({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {})


def test_ingress_is_denied_by_default_to_every_pod():
    deny = POLICIES["default-deny-ingress"]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}
    for name in PODS:
        assert admitted(name, 12345) <= {"worker", "worker-1"} | {p for p in PODS if p.startswith("airflow")}, name
    assert admitted("stranger", 80) == set()


@pytest.mark.parametrize("master", ["master", "dag-master"])
def test_only_worker_pods_reach_the_job_masters_port(master):
    ports = [p["containerPort"] for p in master_pod(S, job_json="/j")["spec"]["containers"][0]["ports"]]
    assert ports == [MASTER_PORT]
    assert admitted(master, MASTER_PORT) == {"worker", "worker-1"}
    assert admitted(master, 22) == set()


def test_workers_reach_each_other_for_rendezvous_and_collectives():
    svc = rendezvous_service(S)
    assert svc["spec"]["ports"][0]["port"] == RDZV_PORT
    # the rendezvous Service's endpoint (worker 0) admits the other workers, on the rendezvous port and any other
    endpoint = next(n for n in ("worker", "worker-1") if selects({"matchLabels": svc["spec"]["selector"]}, PODS[n]))
    assert endpoint == "worker"
    assert admitted("worker", RDZV_PORT) == admitted("worker-1", 40000) == {"worker", "worker-1"}


def test_only_airflow_jobs_and_setup_reach_mlflow_and_only_mlflow_and_airflow_reach_postgres():
    (mlflow,) = [d for d in _docs(INFRA / "mlflow" / "service.yaml")]
    port = mlflow["spec"]["ports"][0]["port"]
    assert admitted("mlflow", port) == {"master", "dag-master", "worker", "worker-1", "mlflow-auth-setup",
                                        "airflow-task", "airflow-api-server", "airflow-scheduler"}
    assert admitted("postgres", 5432) == {"mlflow", "airflow-task", "airflow-api-server", "airflow-scheduler"}
    assert "worker" not in admitted("postgres", 5432) and "stranger" not in admitted("mlflow", port)


def test_airflow_components_reach_each_other_and_nothing_else_reaches_them():
    assert admitted("airflow-api-server", 8080) == {"airflow-task", "airflow-api-server", "airflow-scheduler"}
