"""run_training_job: master + policy + backend for one training job.

It knows nothing about the worker's internals: it fills `master_url` and `threads_per_worker` into
the worker spec (a plain dict, validated by the worker as recforge.train.spec.WorkerSpec), writes it
as JSON, launches the workers through the backend, waits, and returns the master's statistics.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from recforge.config import ResourceConfig
from recforge.elastic.backend import Backend, JobFailedError
from recforge.elastic.master import JobMaster
from recforge.elastic.policy import JobInfo, Policy, ResourcePlan, StaticPolicy

log = logging.getLogger(__name__)

SPEC_FILE = "worker_spec.json"
STATE_FILE = "master_state.json"


@dataclass
class JobResult:
    exit_code: int
    plan: ResourcePlan
    finished: bool  # the master handed out and got back every row of every epoch
    tasks_done: int
    samples: int
    per_worker: dict[str, dict[str, Any]]
    poisoned: list[dict[str, Any]]
    master_state: dict[str, Any] = field(repr=False)
    spec_path: Path | None = None
    state_file: Path | None = None
    log_path: Path | None = None


def default_policy(resources: ResourceConfig) -> Policy:
    if resources.policy == "static":
        return StaticPolicy(resources)
    if resources.policy == "dlrover":  # stage 1 without history (cold start); the pipeline passes MLflow history
        from recforge.elastic.optimizer import DLRoverPolicy, local_default_model
        return DLRoverPolicy(default_model=local_default_model())
    raise NotImplementedError(f"resources.policy={resources.policy!r} is not implemented yet; use 'static'")


def default_backend(resources: ResourceConfig, state_dir: Path) -> Backend:
    if resources.backend == "local":
        from recforge.elastic.local import LocalBackend

        return LocalBackend(max_restarts=resources.max_restarts, log_dir=state_dir)
    raise NotImplementedError(f"resources.backend={resources.backend!r} is not implemented yet; use 'local'")


def run_training_job(
    spec: Mapping[str, Any],
    shard_rows: Sequence[int],
    *,
    resources: ResourceConfig,
    state_dir: str | Path,
    policy: Policy | None = None,
    backend: Backend | None = None,
    rows_per_task: int | None = None,
    epochs: int | None = None,
    lease_timeout_s: float | None = None,
    shuffle_seed: int | None = None,
    timeout_s: float | None = None,
    resume: bool = True,
    check: bool = True,
) -> JobResult:
    """Run one training job to the end.

    `spec`: the worker spec without `master_url`; `rows_per_task`, `epochs` and `lease_timeout_s`
    default to spec["train"]'s batch_size * batches_per_task, epochs and lease_timeout_s.
    `state_dir` holds the spec, the master's state file and the workers' log; with `resume`, an
    existing state file there makes the job continue where it stopped (its in-flight tasks go back
    to TODO), else it starts over. With `check`, a failed or timed-out launch raises JobFailedError
    (with the log's tail), and so does a clean exit that left data unconsumed.
    """
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    train = dict(spec.get("train") or {})
    if rows_per_task is None:
        if "batch_size" not in train or "batches_per_task" not in train:
            raise ValueError("rows_per_task not given and spec['train'] lacks batch_size / batches_per_task")
        rows_per_task = int(train["batch_size"]) * int(train["batches_per_task"])
    epochs = int(epochs if epochs is not None else train.get("epochs", 1))
    lease_timeout_s = float(lease_timeout_s if lease_timeout_s is not None else train.get("lease_timeout_s", 120.0))

    policy = policy or default_policy(resources)
    backend = backend or default_backend(resources, state_dir)
    plan = policy.plan(JobInfo(shard_rows=list(shard_rows), epochs=epochs, rows_per_task=rows_per_task, resources=resources))

    state_file = state_dir / STATE_FILE
    if not resume and state_file.exists():
        state_file.unlink()
    master = JobMaster(
        shard_rows, rows_per_task=rows_per_task, epochs=epochs, state_file=state_file,
        lease_timeout_s=lease_timeout_s, max_retries=3, shuffle_seed=shuffle_seed, new_launch=True,
    )
    spec_path = state_dir / SPEC_FILE
    with master:
        full_spec = {**dict(spec), "master_url": master.url, "threads_per_worker": plan.threads_per_worker}
        tmp = spec_path.with_name(spec_path.name + ".tmp")
        tmp.write_text(json.dumps(full_spec, indent=2, default=str))
        os.replace(tmp, spec_path)
        log.info("launching %d worker(s) x %d thread(s), master %s", plan.workers, plan.threads_per_worker, master.url)
        handle = backend.launch(spec_path, plan)
        try:
            code = backend.wait(handle, timeout=timeout_s, check=check)
            if code is None:
                backend.stop(handle)
                tail = backend.log_tail(handle)
                raise JobFailedError(
                    f"training job timed out after {timeout_s}s and was stopped\n--- last lines ---\n{tail}",
                    exit_code=None, log_path=getattr(handle, "log_path", None), log_tail=tail,
                )
        finally:
            backend.stop(handle)
        state = master.state()

    result = JobResult(
        exit_code=code,
        plan=plan,
        finished=bool(state["finished"]),
        tasks_done=int(state["tasks_done"]),
        samples=int(state["samples"]),
        per_worker=state["workers"],
        poisoned=state["poisoned"],
        master_state=state,
        spec_path=spec_path,
        state_file=state_file,
        log_path=getattr(handle, "log_path", None),
    )
    if check and not result.finished:
        tail = backend.log_tail(handle)
        raise JobFailedError(
            f"workers exited with code {code} but the job master is not finished (epoch {state['epoch']} of "
            f"{state['epochs']}, tasks {state['tasks']}): data was left unconsumed\n--- last lines ---\n{tail}",
            exit_code=code, log_path=result.log_path, log_tail=tail,
        )
    return result
