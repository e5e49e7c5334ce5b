"""KubernetesPodOperator for a recforge job master pod (the recforge_train_k8s DAG's one task).

Beyond the stock operator:
* the pod's image (and the worker image it hands its backend, RECFORGE_IMAGE) must be in the deployment's
  allow-list (recforge.config.deployment), and its namespace the deployment's: checked when the pod request is
  built, before any pod exists; anything else fails the task without a retry, naming the image;
* right after the pod is created, the job's master token is generated here and stored in a Secret owned by the
  pod (recforge.elastic.backends.kubernetes.create_master_token_secret), which the pod and, through its backend,
  every worker pod mount read-only at TOKEN_FILE; the kubelet starts the pod once the Secret exists. The token
  appears in no log, XCom, env literal or MLflow;
* an `execution_timeout` from the deployment (RECFORGE_K8S_JOB_TIMEOUT_S) unless given.
Imported by the DAG file only (Airflow at module level).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk.exceptions import AirflowFailException

from recforge.config.deployment import ImageNotAllowed, K8sDeployment
from recforge.elastic.backends.k8s_manifests import TOKEN_SECRET_ENV, TOKEN_VOLUME, token_secret_name
from recforge.elastic.backends.kubernetes import create_master_token_secret


def deployment() -> K8sDeployment:
    """This deployment's settings (namespace, image allow-list, MLflow, job timeout) from the environment."""
    return K8sDeployment.from_env()


class JobMasterPodOperator(KubernetesPodOperator):
    """`deployment`: the allow-listed images, the namespace and the job timeout (K8sDeployment.from_env())."""

    def __init__(self, *, deployment: K8sDeployment, **kwargs: Any) -> None:
        kwargs.setdefault("execution_timeout", timedelta(seconds=deployment.job_timeout_s))
        super().__init__(**kwargs)
        self.deployment = deployment

    def build_pod_request_obj(self, context: Any = None, *, dry_run: bool = False) -> Any:
        pod = super().build_pod_request_obj(context, dry_run=dry_run)
        (base,) = [c for c in pod.spec.containers if c.name == self.base_container_name]
        env = {e.name: e for e in base.env or []}
        try:
            self.deployment.check_image(base.image)
            if "RECFORGE_IMAGE" in env:  # the image of the workers this master creates
                self.deployment.check_image(env["RECFORGE_IMAGE"].value)
        except ImageNotAllowed as e:
            raise AirflowFailException(f"refused to start the job master pod: {e}") from e
        if pod.metadata.namespace != self.deployment.namespace:
            raise AirflowFailException(f"refused to start the job master pod in namespace {pod.metadata.namespace!r}: "
                                       f"recforge jobs run in {self.deployment.namespace!r} (RECFORGE_K8S_NAMESPACE)")
        # the token Secret is named after the pod, whose name is final only now (a unique suffix)
        secret = token_secret_name(pod.metadata.name)
        for volume in pod.spec.volumes or []:
            if volume.name == TOKEN_VOLUME and volume.secret is not None:
                volume.secret.secret_name = secret
        if TOKEN_SECRET_ENV in env:
            env[TOKEN_SECRET_ENV].value = secret
        return pod

    def get_or_create_pod(self, pod_request_obj: Any, context: Any) -> Any:
        pod = super().get_or_create_pod(pod_request_obj, context)
        name, namespace = pod.metadata.name, pod.metadata.namespace
        try:
            uid = pod.metadata.uid or self.client.read_namespaced_pod(name, namespace, _request_timeout=60).metadata.uid
            create_master_token_secret(self.client, namespace, name, uid)
        except BaseException:
            # a pod without its Secret would wait for it forever, and the operator's cleanup knows no pod yet
            self.log.error("no master token Secret for pod %s/%s: deleting the pod", namespace, name)
            self.pod_manager.delete_pod(pod)
            raise
        return pod
