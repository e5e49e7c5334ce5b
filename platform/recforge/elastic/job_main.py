"""One training job as a process: `python -m recforge.elastic.job_main JOB_JSON`.

What the job master pod runs on Kubernetes (k8s_manifests.master_pod, or Airflow's
KubernetesPodOperator in dags/recforge_train_k8s.py): it reads a `TrainingJob` document (the worker
spec, the data, the resources, where the job's state lives), runs run_training_job with the backend
the resources name (kubernetes: worker pods created from this pod), and writes the result to
`<state_dir>/job_result.json` (and to /airflow/xcom/return.json when that directory exists, for XCom).
Exit code 0 when the job finished, 1 when it failed (the error is logged with the workers' tail).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from recforge.config import ResourceConfig
from recforge.data.manifest import shard_rows_from_manifest
from recforge.elastic.job import run_training_job

XCOM_DIR = Path("/airflow/xcom")


class TrainingJob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: dict[str, Any] = Field(description="worker spec (recforge.train.spec.WorkerSpec) without master_url")
    manifest_dir: str | None = Field(None, description="data manifest; shard rows are read from it")
    shard_rows: list[int] | None = None
    resources: ResourceConfig = Field(default_factory=ResourceConfig)
    state_dir: str = Field(description="master state, worker spec, logs (on the volume the workers share)")
    timeout_s: float | None = None
    resume: bool = True

    @model_validator(mode="after")
    def _data(self) -> TrainingJob:
        if (self.manifest_dir is None) == (self.shard_rows is None):
            raise ValueError("give exactly one of manifest_dir and shard_rows")
        return self


def run(job: TrainingJob) -> dict[str, Any]:
    if job.shard_rows is not None:
        rows = job.shard_rows
    else:
        assert job.manifest_dir is not None  # the model's validator requires one of the two
        rows = shard_rows_from_manifest(job.manifest_dir)
    result = run_training_job(job.spec, rows, resources=job.resources, state_dir=job.state_dir,
                              timeout_s=job.timeout_s, resume=job.resume)
    doc = {k: v for k, v in asdict(result).items() if k != "master_state"}
    doc["plan"] = asdict(result.plan)
    return json.loads(json.dumps(doc, default=str))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recforge.elastic.job_main", description=__doc__.splitlines()[0])
    p.add_argument("job_json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s job %(levelname)s %(name)s: %(message)s")
    job = TrainingJob.model_validate_json(Path(args.job_json).read_text())
    try:
        doc = run(job)
    except Exception as e:
        logging.getLogger("recforge.elastic.job_main").error("training job failed: %s", e)
        return 1
    out = Path(job.state_dir) / "job_result.json"
    out.write_text(json.dumps(doc, indent=2))
    if XCOM_DIR.is_dir() and os.access(XCOM_DIR, os.W_OK):
        (XCOM_DIR / "return.json").write_text(json.dumps({"finished": doc["finished"], "samples": doc["samples"],
                                                          "restarts": doc["restarts"], "result": str(out)}))
    print(json.dumps({"finished": doc["finished"], "restarts": doc["restarts"], "result": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
