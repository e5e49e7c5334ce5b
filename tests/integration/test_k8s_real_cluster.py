"""KubernetesBackend against a real cluster: runs only when KUBECONFIG points to a kubeconfig file (skipped
otherwise); a cluster that does not answer, or a pod that does not finish within 300 s, fails the test.

It creates the job's headless Service and one worker pod in RECFORGE_TEST_NAMESPACE (default
"default"), watches its phases to the end and deletes everything. The image (RECFORGE_TEST_IMAGE)
defaults to busybox, which has no torchrun: the pod must end Failed with a non-zero exit code, which
exercises create / watch / failure / logs / cleanup on a real API server and kubelet. With the
recforge image and a spec on a shared volume the same test would train for real.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _cluster():
    path = os.environ.get("KUBECONFIG")
    if not path or not Path(path.split(os.pathsep)[0]).exists():
        pytest.skip("KUBECONFIG does not point to a kubeconfig file: no real cluster to test against")
    from kubernetes import client, config

    try:
        config.load_kube_config()
        api = client.ApiClient()
        client.VersionApi(api).get_code(_request_timeout=5)
    except Exception as e:  # a configured cluster that does not answer is a failure, not a skip
        pytest.fail(f"the cluster in KUBECONFIG ({path}) does not answer: {e!r}")
    return api


def test_worker_pod_lifecycle_on_a_real_cluster(tmp_path):
    from kubernetes import client

    from recforge.elastic.backends.k8s_manifests import JobPodSettings
    from recforge.elastic.backends.kubernetes import KubernetesBackend
    from recforge.elastic.policy import ResourcePlan

    api = _cluster()
    ns = os.environ.get("RECFORGE_TEST_NAMESPACE", "default")
    job = f"rf-test-{uuid.uuid4().hex[:8]}"
    settings = JobPodSettings(namespace=ns, job_id=job, image=os.environ.get("RECFORGE_TEST_IMAGE", "busybox:1.36"),
                              data_claim=os.environ.get("RECFORGE_TEST_CLAIM", "recforge-data"))
    backend = KubernetesBackend(settings, memory="64Mi", api_client=api, poll_s=2.0, delete_grace_s=0)
    core = client.CoreV1Api(api)
    try:
        handle = backend.launch(tmp_path / "spec.json", ResourcePlan(workers=1, threads_per_worker=1))
        assert core.read_namespaced_service(f"{job}-rdzv", ns).spec.cluster_ip == "None"
        # a configured cluster that cannot run the pod within 300 s is a failure (TimeoutError naming the pods and
        # their phases), not a skip: only "no cluster configured" skips
        backend.wait_timeout_s = 300
        code = backend.wait(handle, check=False)
        assert code != 0 and handle.failed == handle.pods
        assert f"--- pod {handle.pods[0]}" in backend.log_tail(handle)
    finally:
        backend.cleanup()
    left = [p.metadata.name for p in core.list_namespaced_pod(ns, label_selector=f"recforge.io/job={job}").items
            if p.metadata.deletion_timestamp is None]
    assert left == []
