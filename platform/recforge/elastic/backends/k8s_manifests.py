"""Kubernetes manifests of a training job, as plain dicts (validated offline with kubernetes-validate).

* `worker_pod`: one pod per worker node of a launch: torchrun (elastic agent, c10d rendezvous through
  the job's headless Service, restart budget 0: relaunches are the master's) running
  `recforge.worker.main` on the spec the master wrote to the shared volume; CPU / memory / GPU
  requests from the plan; job, generation and index labels; owned by the master pod, so deleting the
  master garbage-collects its workers; optionally a flash-checkpoint agent sidecar sharing /dev/shm.
* `rendezvous_service`: headless, selecting worker 0 of the job (its agent hosts the c10d store).
* `master_pod`: the job master + supervisor (`python -m recforge.elastic.job_main JOB_JSON`) for
  `kubectl apply`; Airflow runs the same command through KubernetesPodOperator (dags/).

The fields mirror infra/jobs/*.yaml (the reviewed templates).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PART_OF = "recforge"
WORKER_APP = "recforge-worker"
MASTER_APP = "recforge-job-master"
JOB_LABEL = "recforge.io/job"
INDEX_LABEL = "recforge.io/worker-index"
GENERATION_LABEL = "recforge.io/launch"
RDZV_PORT = 29400
K8S_VERSION = "1.30.0"  # the oldest Kubernetes these manifests target (validated against its schema)


@dataclass(frozen=True)
class PodResources:
    cpu: float
    memory: str  # a Kubernetes quantity, e.g. "4Gi"
    gpus: int = 0

    def to_dict(self) -> dict[str, Any]:
        requests: dict[str, str] = {"cpu": _cpu(self.cpu), "memory": self.memory}
        limits: dict[str, str] = {"memory": self.memory}
        if self.gpus:
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": requests, "limits": limits}


@dataclass(frozen=True)
class JobPodSettings:
    namespace: str
    job_id: str
    image: str
    data_claim: str = "recforge-data"
    data_mount: str = "/var/lib/recforge"
    service_account: str | None = None
    image_pull_policy: str = "IfNotPresent"
    shm_size: str = "4Gi"
    extra_env: dict[str, str] = field(default_factory=dict)


def _cpu(cores: float) -> str:
    return str(int(cores)) if float(cores).is_integer() else f"{int(round(cores * 1000))}m"


def job_labels(job_id: str, app: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": app, "app.kubernetes.io/part-of": PART_OF, JOB_LABEL: job_id}


def selector(job_id: str, generation: int | None = None) -> str:
    s = f"{JOB_LABEL}={job_id},app.kubernetes.io/name={WORKER_APP}"
    return s if generation is None else f"{s},{GENERATION_LABEL}={generation}"


def rdzv_service_name(job_id: str) -> str:
    return f"{job_id}-rdzv"


def worker_pod_name(job_id: str, generation: int, index: int) -> str:
    return f"{job_id}-worker-{index}-l{generation}"


def _env(pairs: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": str(v)} for k, v in pairs.items()]


def worker_pod(
    s: JobPodSettings, *, index: int, workers: int, generation: int, spec_path: str, resources: PodResources,
    threads: int, owner: dict[str, str] | None = None, flash_agent: dict[str, str] | None = None,
    procs_per_pod: int = 1,
) -> dict[str, Any]:
    """`owner`: {apiVersion, kind, name, uid} of the master pod. `flash_agent`: {memory_root, disk_root}
    to run the flash-checkpoint persister as a sidecar."""
    labels = {**job_labels(s.job_id, WORKER_APP), INDEX_LABEL: str(index), GENERATION_LABEL: str(generation)}
    env = {
        "RECFORGE_JOB_ID": s.job_id,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "RECFORGE_HOME": s.data_mount,
        "PYTHONUNBUFFERED": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        **({"RECFORGE_FLASH_AGENT": "1"} if flash_agent else {}),
        **s.extra_env,
    }
    args = [
        "torchrun", f"--nnodes={workers}", f"--nproc-per-node={procs_per_pod}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_service_name(s.job_id)}:{RDZV_PORT}", f"--rdzv-id={s.job_id}-l{generation}",
        "--max-restarts=0", "-m", "recforge.worker.main", spec_path,
    ]
    mounts = [{"name": "data", "mountPath": s.data_mount}, {"name": "dshm", "mountPath": "/dev/shm"}]
    containers: list[dict[str, Any]] = [{
        "name": "worker",
        "image": s.image,
        "imagePullPolicy": s.image_pull_policy,
        "args": args,
        "env": _env(env) + [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "rdzv", "containerPort": RDZV_PORT}],
        "resources": resources.to_dict(),
        "volumeMounts": mounts,
    }]
    if flash_agent:
        containers.append({
            "name": "flash-agent",
            "image": s.image,
            "imagePullPolicy": s.image_pull_policy,
            "args": ["python", "-m", "recforge.elastic.agent.flash_checkpoint", flash_agent["memory_root"],
                     flash_agent["disk_root"]],
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            "volumeMounts": mounts,
        })
    meta: dict[str, Any] = {"name": worker_pod_name(s.job_id, generation, index), "namespace": s.namespace,
                            "labels": labels}
    if owner:
        meta["ownerReferences"] = [{**owner, "controller": True, "blockOwnerDeletion": True}]
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 60,
        "hostname": f"worker-{index}",
        "securityContext": {"runAsUser": 50000, "runAsGroup": 0, "runAsNonRoot": True, "fsGroup": 0},
        "containers": containers,
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": s.data_claim}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": s.shm_size}},
        ],
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def rendezvous_service(s: JobPodSettings, owner: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": rdzv_service_name(s.job_id), "namespace": s.namespace,
                            "labels": job_labels(s.job_id, WORKER_APP)}
    if owner:
        meta["ownerReferences"] = [{**owner, "controller": True, "blockOwnerDeletion": True}]
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: s.job_id, INDEX_LABEL: "0", "app.kubernetes.io/name": WORKER_APP},
            "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": "rdzv"}],
        },
    }


def master_pod(s: JobPodSettings, *, job_json: str, resources: PodResources | None = None,
               master_port: int = 8470) -> dict[str, Any]:
    """The job master pod (creates its workers, so it runs under the job-master ServiceAccount)."""
    resources = resources or PodResources(cpu=1, memory="2Gi")
    env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        *_env({"RECFORGE_HOME": s.data_mount, "RECFORGE_MASTER_PORT": str(master_port), **s.extra_env}),
    ]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{s.job_id}-master", "namespace": s.namespace,
                     "labels": job_labels(s.job_id, MASTER_APP)},
        "spec": {
            "restartPolicy": "Never",
            "serviceAccountName": s.service_account or MASTER_APP,
            "securityContext": {"runAsUser": 50000, "runAsGroup": 0, "runAsNonRoot": True, "fsGroup": 0},
            "containers": [{
                "name": "master",
                "image": s.image,
                "imagePullPolicy": s.image_pull_policy,
                "args": ["python", "-m", "recforge.elastic.job_main", job_json],
                "env": env,
                "ports": [{"name": "http", "containerPort": master_port}],
                "resources": resources.to_dict(),
                "volumeMounts": [{"name": "data", "mountPath": s.data_mount}],
            }],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": s.data_claim}}],
        },
    }


def validate(manifest: dict[str, Any], version: str = K8S_VERSION) -> None:
    """Raise ValueError naming the field when `manifest` breaks the Kubernetes schema (strict: no
    unknown fields). Offline: kubernetes-validate ships the schemas."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(manifest, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path) or "(root)"
        raise ValueError(f"{manifest.get('kind')} {manifest.get('metadata', {}).get('name')}: {path}: {e.message}") from e
