"""recforge_train_k8s: one elastic training job on Kubernetes, its job master in a pod of its own.

The KubernetesPodOperator starts the master pod (`python -m recforge.elastic.job_main JOB_JSON`,
under the recforge-job-master ServiceAccount, infra/rbac/job-master.yaml). The master creates the
worker pods and their rendezvous Service, watches them, relaunches failed ones (with more memory
after an OOM kill), rescales, and deletes them at the end; the pods are owned by the master pod.
JOB_JSON is a recforge.elastic.job_main.TrainingJob document on the shared volume (worker spec,
data manifest, resources with backend "kubernetes", state directory).

The pod is `recforge.elastic.backends.k8s_manifests.master_pod` (the one that infra/jobs/job-master-pod-template.yaml
is generated from), built by recforge.pipelines.k8s_job with the Params as Jinja values and handed to the operator
(recforge.pipelines.k8s_operator.JobMasterPodOperator) as its pod template. The image is one of the deployment's
allow-list (RECFORGE_K8S_IMAGES, the default first; any other is refused before a pod exists, naming it), the
namespace is the deployment's (RECFORGE_K8S_NAMESPACE): neither is the trigger's to choose. The operator creates
the job's master token Secret, owned by the pod. Wiring only: nothing heavy is imported.
"""
from __future__ import annotations

import pendulum
from airflow.sdk import Param, dag

from recforge.pipelines.k8s_job import DATA_MOUNT, job_master_pod, pod_operator_kwargs
from recforge.pipelines.k8s_operator import JobMasterPodOperator, deployment

DEPLOYMENT = deployment()


@dag(
    dag_id="recforge_train_k8s",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=4,
    params={
        "job_json": Param(f"{DATA_MOUNT}/runs/train/job.json", type="string",
                          description="TrainingJob document on the shared volume"),
        "image": Param(DEPLOYMENT.default_image, type="string", enum=DEPLOYMENT.images,
                       description="master and worker image (the deployment's allow-list, RECFORGE_K8S_IMAGES)"),
        "worker_memory": Param("16Gi", type="string", description="memory request of each worker pod"),
        "worker_gpus": Param(0, type="integer", minimum=0),
    },
    tags=["recforge", "kubernetes"],
    doc_md=__doc__,
)
def recforge_train_k8s():
    pod = job_master_pod(
        namespace=DEPLOYMENT.namespace,
        image="{{ params.image }}",
        job_json="{{ params.job_json }}",
        worker_memory="{{ params.worker_memory }}",
        worker_gpus="{{ params.worker_gpus }}",
        mlflow_tracking_uri=DEPLOYMENT.mlflow_tracking_uri,
        mlflow_secret=DEPLOYMENT.mlflow_secret,
    )
    JobMasterPodOperator(
        task_id="job_master",
        deployment=DEPLOYMENT,
        **pod_operator_kwargs(pod),
        get_logs=True,
        do_xcom_push=True,
        on_finish_action="delete_pod",
        startup_timeout_seconds=600,
    )


recforge_train_k8s()
