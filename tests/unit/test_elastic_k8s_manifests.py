"""Kubernetes manifests of a training job, validated offline against the Kubernetes schema (strict)."""
from __future__ import annotations

import copy

import pytest

from recforge.elastic.backends.k8s_manifests import (
    TOKEN_FILE,
    JobPodSettings,
    PodResources,
    master_pod,
    master_token_secret,
    rendezvous_service,
    selector,
    validate,
    worker_pod,
)
from recforge.elastic.backends.kubernetes import backend_from_environment, memory_bytes, memory_quantity

S = JobPodSettings(namespace="recforge", job_id="daily-1a2b", image="registry.example.com/recforge:0.1.0")
ST = JobPodSettings(namespace="recforge", job_id="daily-1a2b", image="registry.example.com/recforge:0.1.0",
                    token_secret="daily-1a2b-master-token", mlflow_secret="recforge-mlflow-pipeline")
OWNER = {"apiVersion": "v1", "kind": "Pod", "name": "daily-1a2b-master", "uid": "8d1f0c9e-1111-2222-3333-444455556666"}


def pod(**kw):
    args = dict(index=1, workers=4, generation=2, spec_path="/var/lib/recforge/runs/x/worker_spec.json",
                resources=PodResources(cpu=2, memory="8Gi"), threads=2, owner=OWNER)
    return worker_pod(S, **{**args, **kw})


@pytest.mark.parametrize("manifest", [
    pod(), pod(resources=PodResources(cpu=0.5, memory="512Mi", gpus=2), procs_per_pod=2),
    pod(flash_agent={"memory_root": "/dev/shm/recforge-flash-x", "disk_root": "/var/lib/recforge/runs/x/ckpt.steps"}),
    pod(owner=None), rendezvous_service(S, OWNER), master_pod(S, job_json="/var/lib/recforge/runs/x/job.json"),
    worker_pod(ST, index=0, workers=1, generation=0, spec_path="/x", resources=PodResources(cpu=1, memory="1Gi"),
               threads=1, owner=OWNER, flash_agent={"memory_root": "/dev/shm/m", "disk_root": "/d"}),
    master_pod(ST, job_json="/x/job.json"), master_token_secret("recforge", "daily-1a2b-master-token", "t0k", OWNER),
], ids=["worker", "gpu", "flash-sidecar", "no-owner", "rdzv-service", "master", "worker-token", "master-token",
        "token-secret"])
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


def test_worker_pods_keep_freed_pages_unless_the_settings_say_otherwise():
    env = {e["name"]: e.get("value") for e in pod()["spec"]["containers"][0]["env"]}
    assert env["RECFORGE_ALLOCATOR"] == "kept" and env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    assert env["ARROW_DEFAULT_MEMORY_POOL"] == "system"
    own = JobPodSettings(namespace="recforge", job_id="j", image="i", extra_env={"MALLOC_TRIM_THRESHOLD_": "0"})
    p = worker_pod(own, index=0, workers=1, generation=0, spec_path="/x", resources=PodResources(cpu=1, memory="1Gi"),
                   threads=1)
    env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
    assert env["MALLOC_TRIM_THRESHOLD_"] == "0" and env["MALLOC_TOP_PAD_"] == str(64 << 20)
    off = JobPodSettings(namespace="recforge", job_id="j", image="i", extra_env={"RECFORGE_ALLOCATOR": "system"})
    p = worker_pod(off, index=0, workers=1, generation=0, spec_path="/x", resources=PodResources(cpu=1, memory="1Gi"),
                   threads=1)
    names = {e["name"] for e in p["spec"]["containers"][0]["env"]}
    assert "RECFORGE_ALLOCATOR" in names and not names & {"MALLOC_MMAP_THRESHOLD_", "ARROW_DEFAULT_MEMORY_POOL"}


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


def _restricted(pod_manifest):
    """Pod Security Standard "restricted" (the parts these pods could break): non-root, no privilege escalation,
    every capability dropped, the runtime's seccomp profile, volumes of the allowed types only."""
    spec = pod_manifest["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], c["name"]
    allowed = {"configMap", "downwardAPI", "emptyDir", "persistentVolumeClaim", "projected", "secret"}
    assert all(set(v) - {"name"} <= allowed for v in spec["volumes"])
    assert not spec.get("hostNetwork") and not spec.get("hostPID")


def test_the_token_secret_is_mounted_read_only_at_the_same_path_in_master_and_workers():
    w = worker_pod(ST, index=0, workers=2, generation=0, spec_path="/x", resources=PodResources(cpu=1, memory="1Gi"),
                   threads=1, owner=OWNER, flash_agent={"memory_root": "/dev/shm/m", "disk_root": "/d"})
    m = master_pod(ST, job_json="/x/job.json")
    for p in (w, m):
        _restricted(p)
        (vol,) = [v for v in p["spec"]["volumes"] if "secret" in v]
        assert vol["secret"] == {"secretName": "daily-1a2b-master-token", "defaultMode": 0o440,
                                 "items": [{"key": "token", "path": "token"}]}
        main = p["spec"]["containers"][0]
        (mount,) = [mt for mt in main["volumeMounts"] if mt["name"] == vol["name"]]
        assert mount["readOnly"] is True and f"{mount['mountPath']}/token" == TOKEN_FILE
        env = {e["name"]: e for e in main["env"]}
        assert env["RECFORGE_MASTER_TOKEN_FILE"] == {"name": "RECFORGE_MASTER_TOKEN_FILE", "value": TOKEN_FILE}
        assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "recforge-mlflow-pipeline", "key": "password", "optional": True}
    # the flash-checkpoint sidecar talks to no master: no token there
    assert all(mt["name"] != "master-token" for mt in w["spec"]["containers"][1]["volumeMounts"])
    # the master names the Secret to its backend, which mounts it into the workers
    menv = {e["name"]: e.get("value") for e in m["spec"]["containers"][0]["env"]}
    assert menv["RECFORGE_MASTER_TOKEN_SECRET"] == "daily-1a2b-master-token"
    assert menv["RECFORGE_MLFLOW_SECRET"] == "recforge-mlflow-pipeline"
    # without a Secret nothing is mounted and no token file is named (run_training_job keeps one in the state dir)
    plain = pod()
    _restricted(plain)
    assert all("secret" not in v for v in plain["spec"]["volumes"])
    assert "RECFORGE_MASTER_TOKEN_FILE" not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}


def test_the_token_secret_is_owned_by_the_master_pod_and_immutable():
    sec = master_token_secret("recforge", "j-master-token", "t0k", OWNER)
    assert sec["metadata"]["ownerReferences"] == [{**OWNER, "controller": True, "blockOwnerDeletion": True}]
    assert sec["immutable"] is True and sec["stringData"] == {"token": "t0k"}


def test_backend_from_environment_reads_the_token_and_mlflow_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("RECFORGE_IMAGE", "registry.example.com/recforge:2")
    monkeypatch.setenv("RECFORGE_MASTER_TOKEN_SECRET", "j-master-token")
    monkeypatch.setenv("RECFORGE_MLFLOW_SECRET", "mlflow-creds")
    got = backend_from_environment(tmp_path / "runs" / "r" / "state").settings
    assert (got.token_secret, got.mlflow_secret) == ("j-master-token", "mlflow-creds")
    monkeypatch.delenv("RECFORGE_MASTER_TOKEN_SECRET")
    assert backend_from_environment(tmp_path / "runs" / "r" / "state").settings.token_secret is None
