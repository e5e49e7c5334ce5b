"""run_training_job: master + policy + backend for one training job.

It knows nothing about the worker's internals: it fills `master_url` and `threads_per_worker` into
the worker spec (a recforge.train.spec.WorkerSpec, or a plain mapping for another worker program), writes it
as JSON, launches the workers through the backend, waits, and returns the master's statistics.

Failures and elasticity (recforge.elastic.master.supervisor): the supervisor relaunches a failed group per
the FailoverPolicy (budget = resources.max_restarts, shared with torchrun's own restarts), kills a
hung group, relaunches at a new size on a scale request, and, when the spec asks for flash
checkpoints (spec["recovery"]["flash"]), runs the agent that persists them from shared memory.
The spec's "recovery" section gets this launch's generation base, gradient accumulation, the
failures directory and the flash agent flag filled in before every launch.
A shutdown is not a failure: SIGTERM to the process running the job raises JobCancelled once the group is
stopped, and nothing is relaunched (recforge.elastic.shutdown; docs/fault_tolerance.md#shutdown-and-orphans).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from recforge.config import ResourceConfig
from recforge.elastic.agent.client import TOKEN_FILE_ENV, read_token_file, write_token_file
from recforge.elastic.agent.flash_checkpoint import FlashPersister
from recforge.elastic.backends.base import Backend, JobFailedError
from recforge.elastic.backends.kubernetes import backend_from_environment
from recforge.elastic.backends.local import LocalBackend
from recforge.elastic.master.failover import FailoverPolicy
from recforge.elastic.master.service import JobMaster
from recforge.elastic.master.state_log import read_master_state, remove_master_state
from recforge.elastic.master.supervisor import Attempt, Scaler, Supervisor
from recforge.elastic.policy import JobInfo, Policy, ResourcePlan, StaticPolicy
from recforge.elastic.shutdown import JobCancelled, on_shutdown, sigterm_raises
from recforge.train.recovery.private_dir import open_flash_dir, recorded_private_dir
from recforge.train.recovery.spec import RecoverySpec
from recforge.train.spec import WorkerSpec

log = logging.getLogger(__name__)

SPEC_FILE = "worker_spec.json"
STATE_FILE = "master_state.json"
TOKEN_FILE = "master.token"  # the job master's bearer token, 0600, when RECFORGE_MASTER_TOKEN_FILE is not set
FAILURES_DIR = "failures"


def sigterm_cancels_job() -> AbstractContextManager[None]:
    """While the block runs, SIGTERM raises JobCancelled (after the handler installed before, e.g. Airflow's on_kill),
    so `run_training_job`'s cleanup stops the workers at once; run_training_job installs the same itself
    (recforge.elastic.shutdown: one mechanism per process). A no-op outside the main thread."""
    return sigterm_raises(JobCancelled)


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
    attempts: list[dict[str, Any]] = field(default_factory=list)  # one per launch (supervisor.Attempt)
    restarts: int = 0  # group restarts of all kinds (failover relaunches and torchrun's own)
    grad_accumulation: int = 1  # as the last launch ran (an out-of-memory failover raises it)


def default_policy(resources: ResourceConfig) -> Policy:
    if resources.policy == "static":
        return StaticPolicy(resources)
    if resources.policy == "dlrover":  # stage 1 without history (cold start); the pipeline passes MLflow history
        from recforge.elastic.optimizer import DLRoverPolicy, local_default_model  # lazy: scipy, for policy dlrover
        return DLRoverPolicy(default_model=local_default_model())
    raise NotImplementedError(f"resources.policy={resources.policy!r} is not implemented yet; use 'static'")


def default_backend(resources: ResourceConfig, state_dir: Path) -> Backend:
    if resources.backend == "local":
        # torchrun restarts nothing itself: every relaunch goes through the failover policy (one budget)
        return LocalBackend(max_restarts=0, log_dir=state_dir, allocator=resources.allocator)
    if resources.backend == "kubernetes":
        return backend_from_environment(state_dir, allocator=resources.allocator)
    raise NotImplementedError(
        f"resources.backend={resources.backend!r} is not implemented; use 'local' or 'kubernetes'")


def run_training_job(
    spec: WorkerSpec | Mapping[str, Any],
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
    failover: FailoverPolicy | None = None,
    scaler: Scaler | None = None,
    max_workers: int | None = None,
    poll_s: float = 0.5,
    on_attempt: Callable[[Attempt], None] | None = None,
) -> JobResult:
    """Run one training job to the end.

    `spec`: the worker spec without `master_url` (a WorkerSpec, validated again with each launch's fields; a plain
    mapping for another worker program, e.g. the tests' stub); `rows_per_task`, `epochs` and `lease_timeout_s`
    default to spec["train"]'s batch_size * batches_per_task, epochs and lease_timeout_s; `timeout_s` (the whole
    job, relaunches included) to resources.job_timeout_s.
    `state_dir` holds the spec, the master's state file and the workers' log; with `resume`, an
    existing state file there makes the job continue where it stopped (its in-flight tasks go back
    to TODO), else it starts over. With `check`, a failed or timed-out launch raises JobFailedError
    (with the log's tail), and so does a clean exit that left data unconsumed. Without `resume` the
    step checkpoints of an earlier run (spec["recovery"], recforge.train.recovery.spec) go too.
    `failover`: default FailoverPolicy(max_relaunches=resources.max_restarts). `scaler`: called with
    the master's state while the group runs; a different worker count or a `supervisor.Rescale` triggers a
    relaunch (default with a DLRoverPolicy: its stages 2 and 3, recforge.elastic.master.dlrover_scaler).
    `max_workers`: the largest scale request the master accepts (default: this machine's cores for
    the local backend, none otherwise). `on_attempt`: called with each launch's record when its outcome is known.
    """
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = spec.model_dump(mode="json") if isinstance(spec, WorkerSpec) else dict(spec)
    train = dict(raw.get("train") or {})
    if rows_per_task is None:
        if "batch_size" not in train or "batches_per_task" not in train:
            raise ValueError("rows_per_task not given and spec['train'] lacks batch_size / batches_per_task")
        rows_per_task = int(train["batch_size"]) * int(train["batches_per_task"])
    epochs = int(epochs if epochs is not None else train.get("epochs", 1))
    lease_timeout_s = float(lease_timeout_s if lease_timeout_s is not None else train.get("lease_timeout_s", 120.0))
    timeout_s = float(timeout_s if timeout_s is not None else resources.job_timeout_s)  # every wait is bounded

    policy = policy or default_policy(resources)
    backend = backend or default_backend(resources, state_dir)
    plan = policy.plan(JobInfo(shard_rows=list(shard_rows), epochs=epochs, rows_per_task=rows_per_task,
                               resources=resources))

    state_file = state_dir / STATE_FILE
    recovery = _recovery(raw)
    first_generation = 0
    if resume and state_file.exists():  # generations stay unique across runs of one job (ledgers, lockout)
        try:
            first_generation = int(read_master_state(state_file)["queue"]["generation"]) + 1
        except (ValueError, KeyError, TypeError):
            first_generation = 0
    failures_dir = state_dir / FAILURES_DIR
    shutil.rmtree(failures_dir, ignore_errors=True)  # records of an earlier run would alias this run's generations
    if not resume:
        remove_master_state(state_file)
        for d in recovery["roots"]:
            shutil.rmtree(d, ignore_errors=True)
    if max_workers is None and resources.backend == "local":
        max_workers = max(os.cpu_count() or 1, plan.workers)
    failover = failover or FailoverPolicy(
        max_relaunches=resources.max_restarts,
        oom_action="more_memory" if hasattr(backend, "grow_memory") else "accumulate",
    )
    if scaler is None and getattr(policy, "warm", None) is not None and hasattr(policy, "runtime"):
        from recforge.elastic.master.dlrover_scaler import DLRoverScaler  # lazy: scipy, for policy dlrover
        from recforge.elastic.optimizer import DLRoverPolicy  # lazy: scipy, for policy dlrover

        # a policy with a stage-1 plan and a runtime stage is a DLRoverPolicy (checked by duck type above)
        scaler = DLRoverScaler(cast(DLRoverPolicy, policy),
                               memory_action="more_memory" if hasattr(backend, "grow_memory") else "accumulate")
    poll_s = min(poll_s, float(getattr(scaler, "min_interval_s", poll_s)))  # a profiler polls at its own pace
    bind, advertise = getattr(backend, "master_hosts", ("127.0.0.1", "127.0.0.1"))
    # the job's token: the mounted Secret's file (Kubernetes), else a new one in <state_dir>/master.token (0600)
    token_file = Path(os.environ.get(TOKEN_FILE_ENV) or state_dir / TOKEN_FILE)
    token = read_token_file(token_file) if os.environ.get(TOKEN_FILE_ENV) else write_token_file(token_file)
    master = JobMaster(
        shard_rows, rows_per_task=rows_per_task, epochs=epochs, state_file=state_file,
        lease_timeout_s=lease_timeout_s, max_retries=3, shuffle_seed=shuffle_seed, new_launch=True,
        max_workers=max_workers, host=bind, advertise_host=advertise, token=token,
        port=int(os.environ.get("RECFORGE_MASTER_PORT", "0")) if bind != "127.0.0.1" else 0,
    )
    spec_path = state_dir / SPEC_FILE
    persister = None
    if recovery["flash"]:  # the job's private /dev/shm directory; a resumed job reuses the one its pointer records
        recovery["memory_root"] = recovery["memory_root"] or open_flash_dir(recovery["pointer"], fresh=not resume)
        persister = FlashPersister(recovery["memory_root"], recovery["disk_root"], keep=recovery["keep"],
                                   pointer=recovery["pointer"]).start()

    global_batch = (raw.get("recovery") or {}).get("global_batch") or plan.workers * int(train.get("batch_size", 1))

    def write_spec(generation_base: int, grad_accumulation: int, launch_plan: ResourcePlan) -> Path:
        rec = {**dict(raw.get("recovery") or {}), "generation_base": generation_base,
               "grad_accumulation": grad_accumulation, "global_batch": global_batch,
               "failures_dir": str(failures_dir), "flash_agent": persister is not None,
               **({"flash_root": str(persister.memory_root)} if persister is not None else {})}
        full_spec = {**raw, "master_url": master.url, "master_token_file": str(token_file),
                     "threads_per_worker": launch_plan.threads_per_worker, "recovery": rec}
        if isinstance(spec, WorkerSpec):  # validated before any rank reads it
            return WorkerSpec.model_validate(full_spec).save(spec_path)
        tmp = spec_path.with_name(spec_path.name + ".tmp")
        tmp.write_text(json.dumps(full_spec, indent=2, default=str))
        os.replace(tmp, spec_path)
        return spec_path

    outcome = None
    ok = False
    sup: Supervisor | None = None

    def stop_supervisor(why: str) -> None:  # from the SIGTERM handler: relaunch nothing
        if sup is not None:
            sup.shutdown(why)

    try:
        # a SIGTERM to this process (or to an enclosing stage) stops the group and relaunches nothing
        with master, sigterm_raises(JobCancelled), on_shutdown(stop_supervisor):
            log.info("launching %d worker(s) x %d thread(s), master %s", plan.workers, plan.threads_per_worker,
                     master.url)
            sup = Supervisor(
                master, backend, failover, write_spec, plan=plan, batch_size=int(train.get("batch_size", 1)),
                global_batch=global_batch,
                failures_dir=failures_dir, persister=persister, scaler=scaler, timeout_s=timeout_s, poll_s=poll_s,
                first_generation=first_generation, on_attempt=on_attempt,
            )
            try:
                outcome = sup.run()
            except JobFailedError:
                if check:
                    raise
                outcome = None
            finally:
                if sup.handle is not None:
                    backend.stop(sup.handle)
            handle = sup.handle
            state = master.state()
        ok = True
    finally:
        if persister is not None:
            persister.stop(persist=True)
            if ok or persister.on_disk():  # a failed job's memory copy is on disk by now: free it
                persister.cleanup()
        if hasattr(backend, "cleanup"):  # Kubernetes: the job's pods and Service
            backend.cleanup()
    code = outcome.exit_code if outcome is not None else (getattr(handle, "exit_code", None) or 1)
    plan = outcome.plan if outcome is not None else plan

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
        attempts=[asdict(a) for a in sup.attempts],
        restarts=sup.restarts,
        grad_accumulation=sup.grad_accumulation,
    )
    if check and not result.finished:
        tail = backend.log_tail(handle)
        raise JobFailedError(
            f"workers exited with code {code} but the job master is not finished (epoch {state['epoch']} of "
            f"{state['epochs']}, tasks {state['tasks']}): data was left unconsumed\n--- last lines ---\n{tail}",
            exit_code=code, log_path=result.log_path, log_tail=tail,
        )
    return result


def _recovery(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Where the spec's step checkpoints live (empty when it has no checkpoint_dir, e.g. a stub worker). The flash
    directory is the spec's flash_root when given, else made by run_training_job (private_dir.open_flash_dir)."""
    rec = RecoverySpec.model_validate(spec.get("recovery") or {})
    if not spec.get("checkpoint_dir"):
        return {"flash": False, "roots": [], "keep": rec.keep_checkpoints}
    ckpt = Path(spec["checkpoint_dir"])
    disk, memory, pointer = rec.steps_root(ckpt), rec.flash_root, rec.flash_pointer(ckpt)
    recorded = memory if memory is not None else recorded_private_dir(pointer)  # a job that starts over drops it
    return {"flash": rec.flash, "roots": [disk, *([recorded] if recorded is not None else [])], "disk_root": disk,
            "memory_root": memory, "pointer": pointer, "keep": rec.keep_checkpoints}
