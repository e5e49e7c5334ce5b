"""recforge_train_k8s: one elastic training job on Kubernetes, its job master in a pod of its own.

The KubernetesPodOperator starts the master pod (`python -m recforge.elastic.job_main JOB_JSON`,
under the recforge-job-master ServiceAccount, infra/rbac/job-master.yaml). The master creates the
worker pods and their rendezvous Service, watches them, relaunches failed ones (with more memory
after an OOM kill), rescales, and deletes them at the end; the pods are owned by the master pod.
JOB_JSON is a recforge.elastic.job_main.TrainingJob document on the shared volume (worker spec,
data manifest, resources with backend "kubernetes", state directory).

Wiring only: the operator and the Kubernetes models are the provider's; nothing heavy is imported.
"""
from __future__ import annotations

import pendulum
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk import Param, dag
from kubernetes.client import models as k8s

DATA_MOUNT = "/var/lib/recforge"


def _field(name: str, path: str) -> k8s.V1EnvVar:
    return k8s.V1EnvVar(name=name, value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path)))


@dag(
    dag_id="recforge_train_k8s",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=4,
    params={
        "job_json": Param(f"{DATA_MOUNT}/runs/train/job.json", type="string",
                          description="TrainingJob document on the shared volume"),
        "namespace": Param("recforge", type="string"),
        "image": Param("registry.example.com/recforge:0.1.0", type="string", description="master and worker image"),
        "worker_memory": Param("16Gi", type="string", description="memory request of each worker pod"),
        "worker_gpus": Param(0, type="integer", minimum=0),
    },
    tags=["recforge", "kubernetes"],
    doc_md=__doc__,
)
def recforge_train_k8s():
    KubernetesPodOperator(
        task_id="job_master",
        name="recforge-job-master",
        namespace="{{ params.namespace }}",
        image="{{ params.image }}",
        cmds=["python", "-m", "recforge.elastic.job_main"],
        arguments=["{{ params.job_json }}"],
        service_account_name="recforge-job-master",
        labels={"app.kubernetes.io/name": "recforge-job-master", "app.kubernetes.io/part-of": "recforge"},
        env_vars=[
            _field("POD_NAME", "metadata.name"),
            _field("POD_UID", "metadata.uid"),
            _field("POD_IP", "status.podIP"),
            _field("POD_NAMESPACE", "metadata.namespace"),
            k8s.V1EnvVar(name="RECFORGE_IMAGE", value="{{ params.image }}"),
            k8s.V1EnvVar(name="RECFORGE_WORKER_MEMORY", value="{{ params.worker_memory }}"),
            k8s.V1EnvVar(name="RECFORGE_WORKER_GPUS", value="{{ params.worker_gpus }}"),
            k8s.V1EnvVar(name="RECFORGE_HOME", value=DATA_MOUNT),
            k8s.V1EnvVar(name="RECFORGE_MASTER_PORT", value="8470"),
            k8s.V1EnvVar(name="MLFLOW_TRACKING_URI", value="http://recforge-mlflow:5000"),
        ],
        ports=[k8s.V1ContainerPort(name="http", container_port=8470)],
        volumes=[k8s.V1Volume(name="data", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name="recforge-data"))],
        volume_mounts=[k8s.V1VolumeMount(name="data", mount_path=DATA_MOUNT)],
        container_resources=k8s.V1ResourceRequirements(requests={"cpu": "1", "memory": "2Gi"},
                                                       limits={"memory": "2Gi"}),
        security_context=k8s.V1PodSecurityContext(run_as_user=50000, run_as_group=0, run_as_non_root=True, fs_group=0),
        get_logs=True,
        do_xcom_push=True,
        on_finish_action="delete_pod",
        startup_timeout_seconds=600,
    )


recforge_train_k8s()
