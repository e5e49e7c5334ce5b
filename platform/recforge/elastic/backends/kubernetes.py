"""KubernetesBackend: the job's workers as pods, created and watched by the job master (official client).

Per launch (a launch generation): the headless rendezvous Service (once per job) and one pod per
worker (recforge.elastic.backends.k8s_manifests.worker_pod: torchrun with c10d through the Service, the
plan's CPU / memory / GPU requests, job + launch + index labels, owned by the master pod).
`wait` watches the pods' phases (list, then a watch stream, re-listing after every stream so no
event is lost): all Succeeded -> 0; one Failed -> its container's exit code (137 and reason
OOMKilled are reported as out of memory); a pod deleted or evicted -> -1; an explicit `timeout` that
passes -> None (a poll); without one it waits `wait_timeout_s` and then raises TimeoutError naming the
pods and their phases. Every API call carries a request timeout. `stop` deletes the
launch's pods; `cleanup` deletes everything of the job (pods and Service). `grow_memory` is how the
failover policy's "relaunch with more memory" reaches the next launch.

The master must be reachable from the pods: `master_hosts` tells run_training_job to bind on all
interfaces and to advertise the master pod's IP (POD_IP, from the downward API); a NetworkPolicy
(infra/network/) and the job's token (the Secret `settings.token_secret`, mounted into every worker pod)
keep everyone else out. `create_master_token_secret` is how whoever starts a master pod makes that Secret.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recforge.elastic.backends.base import JobFailedError
from recforge.elastic.backends.k8s_manifests import (
    GENERATION_LABEL,
    JOB_LABEL,
    MLFLOW_SECRET_ENV,
    TOKEN_SECRET_ENV,
    WORKER_APP,
    JobPodSettings,
    PodResources,
    master_token_secret,
    rdzv_service_name,
    rendezvous_service,
    selector,
    token_secret_name,
    validate,
    worker_pod,
)
from recforge.elastic.policy import ResourcePlan

log = logging.getLogger(__name__)

_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def memory_bytes(quantity: str) -> int:
    m = _QUANTITY.match(str(quantity).strip())
    if not m:
        raise ValueError(f"memory quantity {quantity!r}: expected a number with an optional Ki/Mi/Gi/Ti/k/M/G/T suffix")
    return int(float(m.group(1)) * _FACTORS[m.group(2)])


def memory_quantity(n_bytes: float) -> str:
    return f"{max(1, -(-int(n_bytes) // 2**20))}Mi"


@dataclass
class K8sHandle:
    generation: int
    pods: list[str]
    plan: ResourcePlan
    phases: dict[str, str] = field(default_factory=dict)
    exit_codes: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    exit_code: int | None = None
    log_path: Path | None = None
    launched_at: float = field(default_factory=time.monotonic)

    @property
    def failed(self) -> list[str]:
        return [p for p in self.pods if self.phases.get(p) in ("Failed", "Gone")]

    @property
    def oom_killed(self) -> bool:
        return any(self.reasons.get(p) == "OOMKilled" for p in self.failed)


class KubernetesBackend:
    """`settings`: namespace, job id, image, data volume, token Secret. `memory`: each worker pod's request (and
    limit); CPU requests follow the plan's threads per worker. `owner`: the master pod ({apiVersion, kind, name,
    uid}; default from POD_NAME / POD_UID). `api_client`: a kubernetes.client.ApiClient (default: in-cluster
    config, else the kubeconfig). `wait_timeout_s`: how long `wait` waits when not told; `request_timeout_s`:
    each API call's."""

    max_restarts = 0  # torchrun in the pods restarts nothing: every relaunch is the supervisor's

    def __init__(
        self, settings: JobPodSettings, *, memory: str = "4Gi", gpus_per_worker: int = 0,
        owner: dict[str, str] | None = None, flash_agent: dict[str, str] | None = None, api_client: Any = None,
        poll_s: float = 2.0, tail_lines: int = 80, delete_grace_s: int = 30, validate_manifests: bool = True,
        wait_timeout_s: float = 24 * 3600.0, request_timeout_s: float = 60.0,
    ) -> None:
        self.settings = settings
        self.memory = memory_quantity(memory_bytes(memory))
        self.gpus_per_worker = gpus_per_worker
        self.owner = owner if owner is not None else _owner_from_env()
        self.flash_agent = flash_agent
        self._api = api_client
        self.poll_s, self.tail_lines, self.delete_grace_s = poll_s, tail_lines, delete_grace_s
        self.validate_manifests = validate_manifests
        self.wait_timeout_s, self.request_timeout_s = wait_timeout_s, request_timeout_s
        self._launches = 0

    # ---- the client ------------------------------------------------------------------------
    @property
    def core(self):
        from kubernetes import client, config  # lazy: the kubernetes client only when this backend runs

        if self._api is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.ApiClient()
        return client.CoreV1Api(self._api)

    @property
    def master_hosts(self) -> tuple[str, str]:
        """(bind address, address the workers use) for the job master."""
        return "0.0.0.0", os.environ.get("POD_IP") or os.environ.get("RECFORGE_MASTER_HOST", "127.0.0.1")

    # ---- Backend ---------------------------------------------------------------------------
    def launch(self, spec_path: Path, plan: ResourcePlan) -> K8sHandle:
        from kubernetes.client import ApiException  # lazy: the kubernetes client only when this backend runs

        generation = self._launches
        self._launches += 1
        core, ns = self.core, self.settings.namespace
        svc = rendezvous_service(self.settings, self.owner)
        self._check(svc)
        try:
            self._call("create Service", core.create_namespaced_service, ns, svc)
        except ApiException as e:
            if e.status != 409:  # it exists already: one Service per job, reused by every launch
                raise
        resources = PodResources(cpu=float(plan.threads_per_worker), memory=self.memory, gpus=self.gpus_per_worker)
        pods = []
        for index in range(plan.workers):
            pod = worker_pod(
                self.settings, index=index, workers=plan.workers, generation=generation, spec_path=str(spec_path),
                resources=resources, threads=plan.threads_per_worker, owner=self.owner, flash_agent=self.flash_agent,
                procs_per_pod=max(1, self.gpus_per_worker),
            )
            self._check(pod)
            self._call("create Pod", core.create_namespaced_pod, ns, pod)
            pods.append(pod["metadata"]["name"])
        log.info("launch %d: created %d worker pod(s) in %s (%s, memory %s)", generation, len(pods), ns,
                 rdzv_service_name(self.settings.job_id), self.memory)
        return K8sHandle(generation=generation, pods=pods, plan=plan, phases={p: "Pending" for p in pods})

    def wait(self, handle: K8sHandle, timeout: float | None = None, check: bool = True) -> int | None:
        """The launch's exit code; None when an explicit `timeout` passes first. Without one, TimeoutError after
        `wait_timeout_s`, naming the pods and their phases."""
        limit = self.wait_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            self._relist(handle)
            code = self._outcome(handle)
            if code is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    if timeout is not None:
                        return None
                    raise TimeoutError(
                        f"worker pods {handle.pods} of launch {handle.generation} in namespace "
                        f"{self.settings.namespace} did not finish within {limit:g} s (phases {handle.phases})")
                self._watch(handle, min(left, self.poll_s))
                code = self._outcome(handle)
            if code is not None:
                handle.exit_code = code
                if check and code != 0:
                    tail = self.log_tail(handle)
                    raise JobFailedError(
                        f"worker pod(s) {handle.failed} of launch {handle.generation} failed (exit code {code}"
                        f"{', OOMKilled' if handle.oom_killed else ''})\n--- last lines ---\n{tail}",
                        exit_code=code, log_tail=tail,
                    )
                return code

    def stop(self, handle: K8sHandle) -> None:
        from kubernetes.client import ApiException  # lazy: the kubernetes client only when this backend runs

        for name in handle.pods:
            try:
                self._call("delete Pod", self.core.delete_namespaced_pod, name, self.settings.namespace,
                           grace_period_seconds=self.delete_grace_s)
            except ApiException as e:
                if e.status != 404:
                    raise
        if handle.exit_code is None:
            handle.exit_code = -15

    def log_tail(self, handle: K8sHandle) -> str:
        from kubernetes.client import ApiException  # lazy: the kubernetes client only when this backend runs

        out = []
        for name in handle.failed or handle.pods:
            try:
                text = self._call("read Pod log", self.core.read_namespaced_pod_log, name, self.settings.namespace,
                                  container="worker", tail_lines=self.tail_lines)
            except ApiException as e:
                text = f"(no log: HTTP {e.status})"
            except TimeoutError as e:
                text = f"(no log: {e})"
            reason = handle.reasons.get(name)
            out.append(f"--- pod {name} ({handle.phases.get(name)}{', ' + reason if reason else ''}) ---\n{text}")
        return "\n".join(out)

    # ---- beyond the protocol ------------------------------------------------------------------
    def pending_s(self, handle: K8sHandle) -> float:
        """Seconds since the launch while any of its pods is still Pending (0 once all left Pending);
        the phases are the ones `wait` saw last."""
        if any(handle.phases.get(p, "Pending") == "Pending" for p in handle.pods):
            return time.monotonic() - handle.launched_at
        return 0.0

    def grow_memory(self, factor: float) -> str:
        """Raise the memory of the next launch's pods (the failover policy's OOM answer)."""
        self.memory = memory_quantity(memory_bytes(self.memory) * factor)
        log.warning("worker pod memory raised to %s for the next launch", self.memory)
        return self.memory

    def cleanup(self) -> None:
        """Delete every pod and the Service of this job (all launches)."""
        from kubernetes.client import ApiException  # lazy: the kubernetes client only when this backend runs

        core, ns = self.core, self.settings.namespace
        for pod in self._call("list Pods", core.list_namespaced_pod, ns,
                              label_selector=selector(self.settings.job_id)).items:
            if _labels(pod).get(JOB_LABEL) == self.settings.job_id:
                try:
                    self._call("delete Pod", core.delete_namespaced_pod, pod.metadata.name, ns,
                               grace_period_seconds=self.delete_grace_s)
                except ApiException as e:
                    if e.status != 404:
                        raise
        try:
            self._call("delete Service", core.delete_namespaced_service, rdzv_service_name(self.settings.job_id), ns)
        except ApiException as e:
            if e.status != 404:
                raise

    # ---- internals -------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return call_api(what, fn, *args, timeout_s=self.request_timeout_s, **kwargs)

    def _check(self, manifest: dict[str, Any]) -> None:
        if self.validate_manifests:
            validate(manifest)

    def _mine(self, pod: Any, handle: K8sHandle) -> bool:
        # label selectors are applied here too: an emulated API server may not filter
        labels = _labels(pod)
        return (labels.get(JOB_LABEL) == self.settings.job_id and labels.get("app.kubernetes.io/name") == WORKER_APP
                and labels.get(GENERATION_LABEL) == str(handle.generation) and pod.metadata.name in handle.pods)

    def _apply(self, pod: Any, handle: K8sHandle, deleted: bool = False) -> None:
        name = pod.metadata.name
        if deleted:
            if handle.phases.get(name) not in ("Succeeded", "Failed"):
                handle.phases[name], handle.reasons[name] = "Gone", "deleted or evicted"
            return
        status = pod.status
        phase = (status.phase if status is not None else None) or "Pending"
        handle.phases[name] = phase
        if status is not None and status.reason:
            handle.reasons[name] = status.reason
        for cs in (status.container_statuses or []) if status is not None else []:
            term = cs.state.terminated if cs.state is not None else None
            if cs.name == "worker" and term is not None:
                handle.exit_codes[name] = int(term.exit_code)
                if term.reason:
                    handle.reasons[name] = term.reason

    def _relist(self, handle: K8sHandle) -> None:
        items = self._call("list Pods", self.core.list_namespaced_pod, self.settings.namespace,
                           label_selector=selector(self.settings.job_id, handle.generation)).items
        seen = set()
        for pod in items:
            if self._mine(pod, handle):
                seen.add(pod.metadata.name)
                self._apply(pod, handle)
        for name in handle.pods:
            if name not in seen and handle.phases.get(name) not in ("Succeeded", "Failed"):
                handle.phases[name], handle.reasons[name] = "Gone", "deleted or evicted"

    def _watch(self, handle: K8sHandle, window_s: float) -> None:
        from kubernetes import watch  # lazy: the kubernetes client only when this backend runs
        from urllib3.exceptions import ProtocolError, ReadTimeoutError  # lazy: comes with the kubernetes client

        w = watch.Watch()
        try:
            for ev in w.stream(self.core.list_namespaced_pod, self.settings.namespace,
                               label_selector=selector(self.settings.job_id, handle.generation),
                               timeout_seconds=max(1, int(window_s)), _request_timeout=max(window_s, 0.5)):
                pod = ev["object"]
                if self._mine(pod, handle):
                    self._apply(pod, handle, deleted=ev["type"] == "DELETED")
                    if self._outcome(handle) is not None:
                        break
        except (ReadTimeoutError, ProtocolError, TimeoutError):
            pass  # the window ended without a decisive event; the caller re-lists
        finally:
            w.stop()

    @staticmethod
    def _outcome(handle: K8sHandle) -> int | None:
        failed = handle.failed
        if failed:
            name = failed[0]
            if handle.phases[name] == "Gone":
                return -1
            return handle.exit_codes.get(name, 1) or 1
        if all(handle.phases.get(p) == "Succeeded" for p in handle.pods):
            return 0
        return None


def call_api(what: str, fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with a request timeout; a timeout or a dropped connection is a TimeoutError naming
    `what` (a Kubernetes API call that would otherwise wait as long as the server keeps the socket open)."""
    from urllib3.exceptions import MaxRetryError, ProtocolError, ReadTimeoutError  # lazy: comes with the client

    try:
        return fn(*args, _request_timeout=timeout_s, **kwargs)
    except (ReadTimeoutError, MaxRetryError, ProtocolError, TimeoutError) as e:
        raise TimeoutError(f"Kubernetes API call '{what}' got no answer within {timeout_s:g} s: {e}") from e


def create_master_token_secret(core: Any, namespace: str, pod_name: str, pod_uid: str, *,
                               request_timeout_s: float = 60.0) -> str:
    """Generate a job master token and store it in the Secret `token_secret_name(pod_name)`, owned by that pod (it
    is deleted with it). A Secret that exists already (the operator re-attached to a running pod) is kept: the pod
    holds its token. Returns the Secret's name; the token itself is never returned, logged or written elsewhere."""
    from kubernetes.client import ApiException  # lazy: the kubernetes client only where pods are created

    name = token_secret_name(pod_name)
    owner = {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid}
    manifest = master_token_secret(namespace, name, secrets.token_urlsafe(32), owner)
    try:
        call_api(f"create Secret {name}", core.create_namespaced_secret, namespace, manifest,
                 timeout_s=request_timeout_s)
        log.info("created the master token Secret %s/%s (owned by pod %s)", namespace, name, pod_name)
    except ApiException as e:
        if e.status != 409:
            raise
        log.info("master token Secret %s/%s exists already: kept", namespace, name)
    return name


def _labels(pod: Any) -> dict[str, str]:
    return dict((pod.metadata.labels or {}) if pod.metadata is not None else {})


def _owner_from_env() -> dict[str, str] | None:
    name, uid = os.environ.get("POD_NAME"), os.environ.get("POD_UID")
    if name and uid:
        return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid}
    return None


def backend_from_environment(state_dir: str | Path, *, allocator: str = "kept") -> KubernetesBackend:
    """The backend of a master running in a pod (master_pod / the Airflow KubernetesPodOperator):
    namespace from POD_NAMESPACE, image from RECFORGE_IMAGE, worker memory from RECFORGE_WORKER_MEMORY,
    GPUs from RECFORGE_WORKER_GPUS, the token Secret its workers mount from RECFORGE_MASTER_TOKEN_SECRET, MLflow
    credentials from RECFORGE_MLFLOW_SECRET, the job id from the state directory's name; `allocator`: the workers'
    allocator mode (the job's resources.allocator)."""
    image = os.environ.get("RECFORGE_IMAGE")
    if not image:
        raise ValueError("resources.backend='kubernetes' needs RECFORGE_IMAGE (the worker image) in the environment")
    name = re.sub(r"[^a-z0-9-]+", "-", Path(state_dir).resolve().parent.name.lower()).strip("-")[:40] or "job"
    job_id = f"{name}-{hashlib.sha1(str(Path(state_dir).resolve()).encode()).hexdigest()[:8]}"
    settings = JobPodSettings(
        namespace=os.environ.get("POD_NAMESPACE", "recforge"), job_id=job_id, image=image,
        data_claim=os.environ.get("RECFORGE_DATA_CLAIM", "recforge-data"),
        data_mount=os.environ.get("RECFORGE_HOME", "/var/lib/recforge"),
        token_secret=os.environ.get(TOKEN_SECRET_ENV) or None,
        mlflow_secret=os.environ.get(MLFLOW_SECRET_ENV) or None, allocator=allocator,
    )
    return KubernetesBackend(settings, memory=os.environ.get("RECFORGE_WORKER_MEMORY", "4Gi"),
                             gpus_per_worker=int(os.environ.get("RECFORGE_WORKER_GPUS", "0")))
