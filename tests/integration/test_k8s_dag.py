"""The Kubernetes-mode DAG: the job master runs through the cncf.kubernetes KubernetesPodOperator."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_dag import REPO, _env


def test_k8s_dag_parses_and_runs_the_job_master_in_a_pod(tmp_path):
    code = (
        "import sys, json\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(REPO / 'dags' / 'recforge_train_k8s.py')!r})\n"
        "dag = bag.dags['recforge_train_k8s']\n"
        "(t,) = dag.tasks\n"
        "spec = t.pod_template_dict['spec']\n"
        "(c,) = spec['containers']\n"
        "heavy = sorted(m for m in ('torch', 'torchrec', 'mlflow', 'pyarrow') if m in sys.modules)\n"
        "print(json.dumps({'errors': {k: str(v) for k, v in bag.import_errors.items()}, 'heavy': heavy,\n"
        "  'type': type(t).__module__ + '.' + type(t).__name__, 'base': t.base_container_name,\n"
        "  'container': c['name'], 'args': c['args'], 'image': c['image'], 'sa': spec['serviceAccountName'],\n"
        "  'env': sorted(e['name'] for e in c['env']), 'schedule': str(dag.schedule),\n"
        "  'volumes': [v['persistentVolumeClaim']['claimName'] for v in spec['volumes']\n"
        "              if 'persistentVolumeClaim' in v],\n"
        "  'secrets': [v['secret']['secretName'] for v in spec['volumes'] if 'secret' in v],\n"
        "  'params': sorted(dag.params.keys())}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True, check=True)
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["errors"] == {} and info["heavy"] == []
    assert info["type"] == "recforge.pipelines.k8s_operator.JobMasterPodOperator"  # a KubernetesPodOperator
    # the pod is k8s_manifests.master_pod (tests/unit/test_k8s_job_pod.py compares the rendered pod), as its template
    assert info["base"] == info["container"] == "master" and info["image"] == "{{ params.image }}"
    assert info["args"] == ["python", "-m", "recforge.elastic.job_main", "{{ params.job_json }}"]
    assert info["sa"] == "recforge-job-master" and info["volumes"] == ["recforge-data"]
    # the token Secret (renamed for the pod's final name when the operator builds the pod)
    assert info["secrets"] == ["recforge-job-master-token"] and "RECFORGE_MASTER_TOKEN_FILE" in info["env"]
    assert {"POD_NAME", "POD_UID", "POD_IP", "POD_NAMESPACE", "RECFORGE_IMAGE"} <= set(info["env"])
    # the namespace is the deployment's, not a Param; the image a Param restricted to the allow-list
    assert info["schedule"] == "None" and {"job_json", "image"} <= set(info["params"])
    assert "namespace" not in info["params"]


def test_training_job_document_is_validated(tmp_path):
    import pytest
    from pydantic import ValidationError

    from recforge.elastic.job_main import TrainingJob

    ok = TrainingJob(spec={}, shard_rows=[4], state_dir=str(tmp_path), resources={"backend": "kubernetes"})
    assert ok.resources.backend == "kubernetes"
    with pytest.raises(ValidationError, match="exactly one of manifest_dir and shard_rows"):
        TrainingJob(spec={}, state_dir=str(tmp_path))
    with pytest.raises(ValidationError, match="backend"):
        TrainingJob(spec={}, shard_rows=[4], state_dir=str(tmp_path), resources={"backend": "slurm"})
    assert Path(REPO / "dags" / "recforge_train_k8s.py").exists()
