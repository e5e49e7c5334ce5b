"""Kubernetes manifests of a training job, validated offline against the Kubernetes schema (strict)."""
from __future__ import annotations

import copy

import pytest

from recforge.elastic.backends.k8s_manifests import (
    JobPodSettings,
    PodResources,
    master_pod,
    rendezvous_service,
    selector,
    validate,
    worker_pod,
)
from recforge.elastic.backends.kubernetes import backend_from_environment, memory_bytes, memory_quantity

S = JobPodSettings(namespace="recforge", job_id="daily-1a2b", image="registry.example.com/recforge:0.1.0")
OWNER = {"apiVersion": "v1", "kind": "Pod", "name": "daily-1a2b-master", "uid": "8d1f0c9e-1111-2222-3333-444455556666"}


def pod(**kw):
    args = dict(index=1, workers=4, generation=2, spec_path="/var/lib/recforge/runs/x/worker_spec.json",
                resources=PodResources(cpu=2, memory="8Gi"), threads=2, owner=OWNER)
    return worker_pod(S, **{**args, **kw})


@pytest.mark.parametrize("manifest", [
    pod(), pod(resources=PodResources(cpu=0.5, memory="512Mi", gpus=2), procs_per_pod=2),
    pod(flash_agent={"memory_root": "/dev/shm/recforge-flash-x", "disk_root": "/var/lib/recforge/runs/x/ckpt.steps"}),
    pod(owner=None), rendezvous_service(S, OWNER), master_pod(S, job_json="/var/lib/recforge/runs/x/job.json"),
], ids=["worker", "gpu", "flash-sidecar", "no-owner", "rdzv-service", "master"])
def test_manifests_pass_the_strict_schema(manifest):
    validate(manifest)


def test_worker_pod_fields():
    p = pod(resources=PodResources(cpu=0.5, memory="512Mi", gpus=2), procs_per_pod=2)
    c = p["spec"]["containers"][0]
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "512Mi", "nvidia.com/gpu": "2"},
                              "limits": {"memory": "512Mi", "nvidia.com/gpu": "2"}}
    assert c["args"][:7] == ["torchrun", "--nnodes=4", "--nproc-per-node=2", "--rdzv-backend=c10d",
                             "--rdzv-endpoint=daily-1a2b-rdzv:29400", "--rdzv-id=daily-1a2b-l2", "--max-restarts=0"]
    assert p["metadata"]["name"] == "daily-1a2b-worker-1-l2"
    assert p["metadata"]["labels"]["recforge.io/launch"] == "2" and p["metadata"]["ownerReferences"][0]["controller"]
    assert selector("daily-1a2b", 2) == ("recforge.io/job=daily-1a2b,app.kubernetes.io/name=recforge-worker,"
                                         "recforge.io/launch=2")
    side = pod(flash_agent={"memory_root": "/dev/shm/m", "disk_root": "/d"})["spec"]["containers"]
    assert [c["name"] for c in side] == ["worker", "flash-agent"]
    assert side[1]["args"][-2:] == ["/dev/shm/m", "/d"]
    assert {"name": "RECFORGE_FLASH_AGENT", "value": "1"} in side[0]["env"]


@pytest.mark.parametrize("path, value, match", [
    (("spec", "containers", 0, "resourcez"), {}, "resourcez"),
    (("spec", "containers", 0, "ports", 0, "containerPort"), "rdzv", "containerPort"),
    (("metadata", "labels"), ["not", "a", "map"], "metadata.labels"),
])
def test_broken_manifests_are_rejected_naming_the_field(path, value, match):
    m = copy.deepcopy(pod())
    node = m
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ValueError, match=match):
        validate(m)


def test_memory_quantities():
    assert memory_bytes("4Gi") == 4 * 2**30 and memory_bytes("1500M") == 1_500_000_000 and memory_bytes("1024") == 1024
    assert memory_quantity(int(memory_bytes("1Gi") * 1.5)) == "1536Mi"
    with pytest.raises(ValueError, match="memory quantity 'lots'"):
        memory_bytes("lots")


def test_a_master_pod_gives_its_backend_the_image_and_volume_of_its_workers(tmp_path, monkeypatch):
    """master_pod's environment is what backend_from_environment reads: the workers it creates run the master's
    image on the master's data volume."""
    settings = JobPodSettings(namespace="ns", job_id="j", image="registry.example.com/recforge:2", data_claim="claim-x",
                              data_mount=str(tmp_path))
    env = master_pod(settings, job_json="/x/job.json")["spec"]["containers"][0]["env"]
    for e in env:
        if "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    got = backend_from_environment(tmp_path / "runs" / "r" / "state").settings
    assert (got.image, got.data_claim, got.data_mount) == (settings.image, settings.data_claim, settings.data_mount)
