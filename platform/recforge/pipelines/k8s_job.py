"""The job master pod of the recforge_train_k8s DAG: `k8s_manifests.master_pod`, the pod `kubectl apply` runs
(infra/jobs/job-master-pod-template.yaml), handed to KubernetesPodOperator as its pod template, so the DAG and
the manifests describe one pod shape.

Values may be Jinja strings ("{{ params.image }}"): the operator renders `pod_template_dict` (a template field)
before it builds the pod. Plain dicts, no Airflow import: testable without Airflow.
"""
from __future__ import annotations

from typing import Any

from recforge.elastic.backends.k8s_manifests import (
    JOB_LABEL,
    MASTER_APP,
    JobPodSettings,
    master_pod,
    token_secret_name,
)

DATA_MOUNT = JobPodSettings.data_mount  # where the pods mount the shared volume (JOB_JSON lives on it)
MLFLOW_TRACKING_URI = "http://recforge-mlflow:5000"  # the in-cluster MLflow Service (infra/mlflow/service.yaml)


def job_master_pod(*, namespace: str, image: str, job_json: str, worker_memory: str, worker_gpus: str,
                   mlflow_tracking_uri: str = MLFLOW_TRACKING_URI, mlflow_secret: str | None = None) -> dict[str, Any]:
    """`master_pod` for a master the DAG starts; the worker memory / GPUs reach the master's backend through
    its environment (RECFORGE_WORKER_MEMORY / RECFORGE_WORKER_GPUS, read by backend_from_environment).

    The job id is the master's to derive (from the state directory JOB_JSON names), unknown when the DAG is
    parsed: the pod is named for its app (the operator appends a unique suffix) and carries no job label. It mounts
    the job's master token Secret (named here for the unsuffixed pod; recforge.pipelines.k8s_operator renames it
    for the pod's final name and creates it); `mlflow_secret`: MLflow credentials for the job's MLflow clients."""
    settings = JobPodSettings(namespace=namespace, job_id="", image=image, extra_env={
        "RECFORGE_WORKER_MEMORY": worker_memory, "RECFORGE_WORKER_GPUS": worker_gpus,
        "MLFLOW_TRACKING_URI": mlflow_tracking_uri,
    }, token_secret=token_secret_name(MASTER_APP), mlflow_secret=mlflow_secret)
    pod = master_pod(settings, job_json=job_json)
    meta = pod["metadata"]
    meta["name"] = MASTER_APP
    meta["labels"] = {k: v for k, v in meta["labels"].items() if k != JOB_LABEL}
    return pod


def pod_operator_kwargs(pod: dict[str, Any]) -> dict[str, Any]:
    """KubernetesPodOperator arguments that run `pod` (one container, e.g. `job_master_pod(...)`): the pod as the
    operator's template, its container as the operator's base container (logs, XCom sidecar, completion)."""
    (container,) = pod["spec"]["containers"]
    return {"pod_template_dict": pod, "base_container_name": container["name"]}
