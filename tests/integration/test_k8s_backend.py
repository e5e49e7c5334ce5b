"""KubernetesBackend against the kmock Kubernetes emulator (PyPI `kmock`), run out of process on loopback.

No API server can run here. kmock keeps objects in memory and serves create / list / watch / patch /
delete; a small fake kubelet (a thread using the official client, like a real kubelet) moves each
worker pod through Pending -> Running -> Succeeded, or fails chosen pods with an exit code and reason.
In the end-to-end test the kubelet also plays the pod's workload: one rank speaking the job master's
protocol (join, lease, done), so run_training_job's supervisor, the master and the backend run for real.

kmock is installed outside the venv's site-packages (its pytest plugin needs pytest-asyncio):
    pip install --no-deps --target .venv/kmock-emulator kmock==0.8 jsonpatch==1.33 jsonpointer==3.0.0
(RECFORGE_KMOCK_PATH overrides the location). This file is also the emulator's entry point:
    PYTHONPATH=.venv/kmock-emulator python tests/integration/test_k8s_backend.py serve URL_FILE
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KMOCK_PATH = Path(os.environ.get("RECFORGE_KMOCK_PATH", REPO / ".venv" / "kmock-emulator"))
NS = "recforge-test"
OWNER = {"apiVersion": "v1", "kind": "Pod", "name": "job-master-0", "uid": "0e9d5a4e-6a43-4c4f-9a52-1f0e1b2c3d4e"}


def serve(url_file: str) -> None:
    """The emulator process: kmock's KubernetesEmulator on 127.0.0.1, any free port."""
    import asyncio
    import uuid

    from kmock._internal import apps, enums, k8s, parsing

    guess = parsing.guess_k8s

    def guess_k8s(path, method, query):  # the API server parses booleans like Go (?watch=True works); kmock not
        q = dict(query)
        if "watch" in q:
            q["watch"] = "true" if q["watch"].lower() in ("true", "1", "t") else "false"
        return guess(path, method, q)

    parsing.guess_k8s = guess_k8s
    handle = k8s.KubernetesEmulator._handle

    async def handle_with_uid(self, request):  # an API server gives every new object a uid (owner references use it)
        if request.resource is not None and request.action == enums.action.CREATE and isinstance(request.data, dict):
            request.data.setdefault("metadata", {}).setdefault("uid", str(uuid.uuid4()))
        return await handle(self, request)

    k8s.KubernetesEmulator._handle = handle_with_uid

    async def main() -> None:
        async with k8s.KubernetesEmulator() as emulator, apps.Server(emulator) as server:
            emulator.resources["v1/pods"].kind = "Pod"  # served even while no object of the kind exists
            emulator.resources["v1/services"].kind = "Service"
            emulator.resources["v1/secrets"].kind = "Secret"
            tmp = Path(url_file + ".tmp")
            tmp.write_text(str(server.url))
            tmp.replace(url_file)
            await asyncio.Event().wait()

    asyncio.run(main())


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
        sys.exit(0)

import pytest  # noqa: E402

pytestmark = pytest.mark.skipif(not (KMOCK_PATH / "kmock").is_dir(),
                                reason=f"kmock emulator not installed at {KMOCK_PATH} (see this module's docstring)")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from kubernetes import client

    url_file = tmp_path_factory.mktemp("kmock") / "url"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(KMOCK_PATH), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, __file__, "serve", str(url_file)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not url_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
            time.sleep(0.05)
        cfg = client.Configuration()
        cfg.host = url_file.read_text().strip()
        yield client.ApiClient(cfg)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class FakeKubelet(threading.Thread):
    """Moves pods of namespace NS through their phases. `fail`: {(launch, index): (exit code, reason)}.
    `hold`: pods stay Running. `pend`: launches whose pods stay Pending (never scheduled).
    `workload(pod) -> exit code`: run while the pod is Running."""

    def __init__(self, api, *, fail=None, hold=False, workload=None, step_s=0.1, pend=()):
        super().__init__(daemon=True, name="fake-kubelet")
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.fail, self.hold, self.workload, self.step_s = dict(fail or {}), hold, workload, step_s
        self.pend = set(pend)
        self.stopped = threading.Event()
        self.running: dict[str, threading.Thread] = {}
        self.results: dict[str, int] = {}
        self.seen: list[str] = []

    def run(self):
        while not self.stopped.wait(self.step_s):
            for pod in self.core.list_namespaced_pod(NS).items:
                self._tick(pod)

    def stop(self):
        self.stopped.set()
        self.join(timeout=10)

    def _patch(self, name, status):
        from kubernetes.client import ApiException

        try:
            self.core.patch_namespaced_pod(name, NS, {"status": status})
        except ApiException as e:
            if e.status != 404:  # deleted meanwhile
                raise

    def _tick(self, pod):
        name, phase = pod.metadata.name, pod.status.phase if pod.status else None
        labels = pod.metadata.labels or {}
        key = (int(labels.get("recforge.io/launch", -1)), int(labels.get("recforge.io/worker-index", -1)))
        if phase is None:
            self.seen.append(name)
            self._patch(name, {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]})
        elif phase == "Pending" and key[0] not in self.pend:
            self._patch(name, {"phase": "Running", "podIP": f"10.1.0.{len(self.seen)}", "containerStatuses": [
                {"name": "worker", "ready": True, "restartCount": 0, "image": "x", "imageID": "x",
                 "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})
        elif phase == "Running" and not self.hold:
            if key in self.fail:
                code, reason = self.fail.pop(key)
                self._terminate(name, code, reason)
            elif self.workload is None:
                self._terminate(name, 0, "Completed")
            elif name not in self.running:
                t = threading.Thread(target=self._run_workload, args=(pod,), daemon=True)
                self.running[name] = t
                t.start()
            elif name in self.results:
                self._terminate(name, self.results[name], "Completed" if self.results[name] == 0 else "Error")

    def _run_workload(self, pod):
        try:
            self.results[pod.metadata.name] = self.workload(pod)
        except Exception as e:  # the "container" crashed
            print(f"workload of {pod.metadata.name} failed: {e!r}")
            self.results[pod.metadata.name] = 1

    def _terminate(self, name, code, reason):
        self._patch(name, {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
            {"name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "x",
             "state": {"terminated": {"exitCode": code, "reason": reason}}}]})


def settings(job_id):
    from recforge.elastic.backends.k8s_manifests import JobPodSettings

    return JobPodSettings(namespace=NS, job_id=job_id, image="registry.example.com/recforge:test")


def pods_of(api, job_id):
    from kubernetes import client

    return [p for p in client.CoreV1Api(api).list_namespaced_pod(NS).items
            if (p.metadata.labels or {}).get("recforge.io/job") == job_id]


def services_of(api, job_id):
    from kubernetes import client

    return [s for s in client.CoreV1Api(api).list_namespaced_service(NS).items
            if (s.metadata.labels or {}).get("recforge.io/job") == job_id]


def test_backend_creates_watches_fails_relaunches_and_cleans_up(api, tmp_path):
    from recforge.elastic.backends.base import JobFailedError
    from recforge.elastic.backends.kubernetes import KubernetesBackend
    from recforge.elastic.policy import ResourcePlan

    backend = KubernetesBackend(settings("t1"), memory="1Gi", owner=OWNER, api_client=api, poll_s=0.5)
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    kubelet = FakeKubelet(api, fail={(1, 2): (137, "OOMKilled")})
    kubelet.start()
    try:
        h = backend.launch(spec, ResourcePlan(workers=3, threads_per_worker=2))
        (svc,) = services_of(api, "t1")
        assert svc.metadata.name == "t1-rdzv" and svc.spec.cluster_ip == "None"
        assert svc.spec.selector == {"recforge.io/job": "t1", "recforge.io/worker-index": "0",
                                     "app.kubernetes.io/name": "recforge-worker"}
        pods = {p.metadata.name: p for p in pods_of(api, "t1")}
        assert sorted(pods) == [f"t1-worker-{i}-l0" for i in range(3)] == sorted(h.pods)
        p0 = pods["t1-worker-0-l0"]
        assert p0.metadata.labels["recforge.io/launch"] == "0" and p0.metadata.labels["recforge.io/worker-index"] == "0"
        assert p0.metadata.owner_references[0].uid == OWNER["uid"] and p0.metadata.owner_references[0].controller
        c = p0.spec.containers[0]
        assert c.resources.requests == {"cpu": "2", "memory": "1024Mi"} and c.resources.limits == {"memory": "1024Mi"}
        assert "--nnodes=3" in c.args and "--rdzv-endpoint=t1-rdzv:29400" in c.args and c.args[-1] == str(spec)
        assert {e.name: e.value for e in c.env}["OMP_NUM_THREADS"] == "2"
        assert p0.spec.restart_policy == "Never"

        assert backend.wait(h, timeout=30) == 0
        assert set(h.phases.values()) == {"Succeeded"}
        backend.stop(h)
        assert pods_of(api, "t1") == []

        h2 = backend.launch(spec, ResourcePlan(workers=3, threads_per_worker=2))
        with pytest.raises(JobFailedError, match=r"t1-worker-2-l1.*exit code 137, OOMKilled") as err:
            backend.wait(h2, timeout=30)
        assert err.value.exit_code == 137 and h2.oom_killed
        assert "--- pod t1-worker-2-l1 (Failed, OOMKilled) ---" in err.value.log_tail  # (kmock has no real logs)
        backend.stop(h2)
        assert backend.grow_memory(1.5) == "1536Mi"
        kubelet.hold = True
        h3 = backend.launch(spec, ResourcePlan(workers=1, threads_per_worker=1))
        (p,) = pods_of(api, "t1")
        assert p.spec.containers[0].resources.requests["memory"] == "1536Mi"
        assert backend.wait(h3, timeout=1.5) is None  # still running: an explicit timeout is a poll
        backend.wait_timeout_s = 1.0  # no timeout given: the backend's own, which fails naming what it waited for
        with pytest.raises(TimeoutError, match=r"worker pods \['t1-worker-0-l2'\] of launch 2 in namespace "
                                               r"recforge-test did not finish within 1 s \(phases .*Running"):
            backend.wait(h3)
        backend.cleanup()
        assert pods_of(api, "t1") == [] and services_of(api, "t1") == []
        assert backend.wait(h3, timeout=5, check=False) == -1  # its pod was deleted under it
    finally:
        kubelet.stop()


def test_run_training_job_on_kubernetes_relaunches_a_failed_pod(api, tmp_path):
    """run_training_job with the Kubernetes backend; each pod's workload is one rank of the master
    protocol. Launch 0's pod 1 crashes holding a lease: the supervisor relaunches, the new launch's
    ranks take over, every row is done exactly once, and the job's objects are cleaned up."""
    from collections import Counter

    from recforge.config import ResourceConfig
    from recforge.elastic.agent.client import MasterClient
    from recforge.elastic.backends.kubernetes import KubernetesBackend
    from recforge.elastic.job import run_training_job
    from recforge.elastic.policy import StaticPolicy

    shards = [40, 24, 16]
    done_rows: Counter = Counter()
    lock = threading.Lock()

    def rank(pod) -> int:
        spec = json.loads(Path(pod.spec.containers[0].args[-1]).read_text())
        launch = int(pod.metadata.labels["recforge.io/launch"])
        index = int(pod.metadata.labels["recforge.io/worker-index"])
        # the job's token, from the file the spec names (in a pod: the mounted Secret; here: the state directory)
        token = {"token": Path(spec["master_token_file"]).read_text().strip()} if spec.get("master_token_file") else {}
        c = MasterClient(spec["master_url"], f"{pod.metadata.name}", generation=spec["recovery"]["generation_base"],
                         max_attempts=2, poll_interval_s=0.02, **token)
        c.join()
        leases = 0
        while not c.finished:
            t = c.lease()
            if t is None:
                continue
            leases += 1
            if (launch, index) == (0, 1) and leases == 2:
                return 3  # dies holding a lease
            time.sleep(0.01)
            if c.done(t.task_id, t.rows):
                with lock:
                    done_rows.update((t.epoch, t.shard, r) for r in range(t.row_start, t.row_end))
        return 0

    backend = KubernetesBackend(settings("t2"), memory="512Mi", owner=OWNER, api_client=api, poll_s=0.3)
    res = ResourceConfig(policy="static", workers=2, threads_per_worker=1, max_restarts=2, backend="kubernetes")
    kubelet = FakeKubelet(api, workload=rank)
    kubelet.start()
    try:
        result = run_training_job(
            {"train": {"epochs": 2, "batch_size": 4, "batches_per_task": 2, "lease_timeout_s": 600.0}}, shards,
            resources=res, state_dir=tmp_path / "job", policy=StaticPolicy(res, cpu_count=4), backend=backend,
            timeout_s=120, poll_s=0.2,
        )
    finally:
        kubelet.stop()
    assert result.finished and result.restarts == 1
    assert [a["outcome"] for a in result.attempts] == ["failed", "finished"]
    assert result.attempts[0]["exit_code"] == 3 and result.attempts[0]["failure"].startswith("killed")
    expected = {(e, s, r) for e in range(2) for s, n in enumerate(shards) for r in range(n)}
    assert set(done_rows) == expected and set(done_rows.values()) == {1}
    assert result.master_state["rows_done_total"] == 2 * sum(shards)
    assert {n.rsplit("-", 1)[-1] for n in kubelet.seen} == {"l0", "l1"}
    assert pods_of(api, "t2") == [] and services_of(api, "t2") == []  # cleaned up on completion


# The DAG's operator against the emulator: what it creates for an allow-listed image (the master pod, then the job's
# token Secret owned by that pod) and what it creates for any other image (nothing). Airflow runs in a subprocess.
OPERATOR = """
import importlib.util, json, sys, types
spec = importlib.util.spec_from_file_location("recforge_train_k8s", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
out = {}
for case, image in json.loads(sys.argv[3]).items():
    dag = module.recforge_train_k8s()
    (task,) = dag.tasks
    task.config_file, task.in_cluster = sys.argv[2], False
    params = {**{k: dag.params[k] for k in dag.params}, "image": image}
    task.render_template_fields({"params": params}, jinja_env=dag.get_template_env())
    ti = types.SimpleNamespace(dag_id=dag.dag_id, task_id=task.task_id, try_number=1, map_index=-1)
    context = {"ti": ti, "run_id": "manual__1", "dag": dag, "params": params}
    try:
        if case == "refused":
            task.execute(context)  # the whole task: it must fail before it creates anything
        else:  # up to the pod and its Secret (no kubelet runs the pod here)
            request = task.build_pod_request_obj(context)
            pod = task.get_or_create_pod(request, context)
            out[case] = {"pod": pod.metadata.name}
    except Exception as e:
        out[case] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


def test_the_dag_operator_creates_the_token_secret_owned_by_its_pod_and_refuses_other_images(api, tmp_path):
    import base64

    import yaml
    from kubernetes import client

    core = client.CoreV1Api(api)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": api.configuration.host}}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
    }))
    allowed = "registry.example.com/recforge:0.3.0"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "MLFLOW", "KUBECONFIG"))}
    env.update(AIRFLOW_HOME=str(tmp_path / "af"), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               RECFORGE_HOME=str(tmp_path / "home"), RECFORGE_K8S_NAMESPACE=NS,
               RECFORGE_K8S_IMAGES=f"registry.example.com/recforge:0.2.0,{allowed}")
    before = {p.metadata.name for p in core.list_namespaced_pod(NS).items}

    # both cases in one Airflow process (its import is most of the cost), the refused one first: after both, the
    # only new pod is the allowed one's and the only Secret its token (the refused case created nothing)
    both = subprocess.run([sys.executable, "-c", OPERATOR, str(REPO / "dags" / "recforge_train_k8s.py"),
                           str(kubeconfig), json.dumps({"refused": "docker.io/evil/miner:1", "allowed": allowed})],
                          env=env, capture_output=True, text=True, timeout=300)
    assert both.returncode == 0, both.stderr[-3000:]
    out = json.loads(both.stdout.strip().splitlines()[-1])
    err = out["refused"]["error"]
    assert err.startswith("AirflowFailException: refused to start the job master pod: image 'docker.io/evil/miner:1' "
                          "is not allow-listed"), err
    got = out["allowed"]
    assert "pod" in got, got
    name = got["pod"]
    assert {p.metadata.name for p in core.list_namespaced_pod(NS).items} == before | {name}
    pod = core.read_namespaced_pod(name, NS)
    assert pod.spec.containers[0].image == allowed and pod.spec.service_account_name == "recforge-job-master"
    (secret,) = core.list_namespaced_secret(NS).items
    assert secret.metadata.name == f"{name}-token"
    (ref,) = secret.metadata.owner_references
    assert (ref.kind, ref.name, ref.uid, ref.controller) == ("Pod", name, pod.metadata.uid, True)
    (vol,) = [v for v in pod.spec.volumes if v.secret is not None]
    assert vol.secret.secret_name == secret.metadata.name and vol.secret.default_mode == 0o440
    (mount,) = [m for m in pod.spec.containers[0].volume_mounts if m.name == vol.name]
    assert mount.read_only and mount.mount_path == "/var/run/secrets/recforge/master-token"
    env_of = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env_of["RECFORGE_MASTER_TOKEN_SECRET"] == secret.metadata.name
    data = secret.data or {k: base64.b64encode(v.encode()).decode() for k, v in (secret.string_data or {}).items()}
    token = base64.b64decode(data["token"]).decode()
    assert len(token) >= 40  # secrets.token_urlsafe(32)
    # the token is in the Secret only: not in the pod spec, nor in anything the task printed or logged
    assert token not in json.dumps(client.ApiClient().sanitize_for_serialization(pod))
    assert token not in both.stdout + both.stderr
    core.delete_namespaced_pod(name, NS)
    core.delete_namespaced_secret(secret.metadata.name, NS)  # (the emulator has no garbage collector)
