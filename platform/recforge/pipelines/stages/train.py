"""Elastic TorchRec training under a job master; the trained model as later stages load it.

The job lives in a work dir per run (`<run_dir>/.train.work`: master state, step checkpoints, ledger, events, the
workers' log) that outlives a killed task process, so an Airflow retry resumes from the newest valid checkpoint;
it is removed once the stage has committed. Design: docs/fault_tolerance.md#retries-of-the-train-task.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from recforge.elastic.backends.local import LocalBackend, LogRelay
from recforge.elastic.job import run_training_job, sigterm_cancels_job
from recforge.elastic.master.service import shard_rows_from_manifest
from recforge.elastic.policy import StaticPolicy
from recforge.pipelines.context import RunContext
from recforge.pipelines.hooks import warm_start
from recforge.pipelines.outputs import (
    CheckpointRecord,
    ExecutorRecord,
    IngestOutputs,
    JobRecord,
    PlanOutputs,
    TrainOutputs,
)
from recforge.pipelines.stage import run_stage
from recforge.preprocess.planning.plan import Plan
from recforge.train.recovery.spec import RecoverySpec
from recforge.train.result import WorkerResult
from recforge.train.spec import WorkerSpec

log = logging.getLogger("recforge.pipelines.train")

WORK_DIR = ".train.work"
PID_FILE = "task.pid"  # the pid of the task process running the job (tests kill it)
JOB_FILE = "job.json"  # what the work dir's state belongs to; another job's state is never resumed
EVENTS_FILE = "events.jsonl"  # group starts, step checkpoints, finishes (recforge.worker.trainer.Events)
ATTEMPTS_FILE = "attempts.jsonl"  # one line per worker-group launch (supervisor.Attempt)
TASKS_FILE = "tasks.jsonl"  # one line per task attempt that ran this stage
PROGRESS_INTERVAL_S = 5.0  # how often the workers' log is relayed into the task's log


def work_dir(ctx: RunContext) -> Path:
    return ctx.run_dir / WORK_DIR


def train(ctx: RunContext) -> TrainOutputs:
    data = ctx.read(IngestOutputs)
    plan = ctx.read(PlanOutputs)
    work = work_dir(ctx)
    _drop_dead_tmp_dirs(ctx.run_dir)

    def body(w, store, run_id):
        cfg = ctx.config
        manifest_dir = data.train.manifest_dir
        mode = _preprocessing_mode(cfg, plan)  # the mode plan_resources chose (preprocessing: auto decides there)
        ck = cfg.checkpoint
        task = _open_work(work, _fingerprint(cfg, data, plan))
        # continuous training: the champion's checkpoint when it matches this run (a retry keeps the first choice)
        warm, init_checkpoint = warm_start.choose(ctx, store, run_id, plan, work)
        spec = WorkerSpec(  # master_url and the launch's recovery fields are the launcher's (run_training_job)
            manifest_dir=manifest_dir,
            plan_path=plan.plan_path,
            preprocess_executor=plan.preprocess_executor,
            dataset=cfg.dataset(),
            model=cfg.model,
            train=cfg.train,
            checkpoint_dir=w.tmp / "checkpoint",
            output_dir=w.tmp / "worker",
            threads_per_worker=plan.threads_per_worker,
            seed=cfg.seed,
            tracking_uri=store.tracking_uri,
            mlflow_run_id=run_id,
            preprocessing=mode,  # RAP co-run: the schedule plan_resources made (recforge.rap)
            corun_schedule_path=plan.corun.schedule_path if plan.corun else None,
            corun_mapping_path=plan.corun.mapping_path if plan.corun else None,
            corun_threads=cfg.corun.threads,
            preprocessed_dir=w.tmp / "preprocessed" if mode == "offline" else None,
            init_checkpoint=init_checkpoint,  # loaded only when the job has no step checkpoint of its own
            # step checkpoints, ledger and events in the work dir: what a retry of this task resumes from
            recovery=RecoverySpec(checkpoint_every_steps=ck.every_steps, keep_checkpoints=ck.keep, flash=ck.flash,
                                  checkpoint_root=work / "steps", ledger_dir=work / "ledger",
                                  events_file=work / EVENTS_FILE),
        )
        offline_ran: dict[str, Any] | None = None
        if mode == "offline":  # preprocess the whole training data first (recforge.rap.runtime.offline)
            from recforge.pipelines.hooks.rap_training import (
                preprocess_offline,  # lazy: torch off the UI/CLI import path
            )
            from recforge.preprocess.executors import record as executed  # lazy: torch off the UI/CLI import path

            before = executed.mark()  # offline: this task's process runs the executor, not the workers
            preprocess_offline(store, run_id, manifest_dir, plan.plan_path, cfg.dataset(), spec.preprocess_executor,
                               w.tmp / "preprocessed")
            offline_ran = executed.summarize(spec.preprocess_executor, executed.since(before), preprocessing=mode,
                                             where="train task (offline)")
        store.log_params(run_id, {"train": cfg.train.model_dump(mode="json"),
                                  "model": cfg.model.model_dump(mode="json"),
                                  "checkpoint": ck.model_dump(mode="json")})
        from recforge.pipelines.hooks import (
            dlrover_training as train_dlrover,  # lazy: mlflow off the UI/CLI import path (DLRover-RM stages 2/3)
        )

        scaler, spec = train_dlrover.start(store, run_id, plan, cfg, spec, work)  # its ledger: work/ledger
        # RAP's mapping trains global batches: one task feeds every worker, so it is `workers` times larger
        tasks = ({"rows_per_task": cfg.train.batch_size * cfg.train.batches_per_task * plan.workers}
                 if spec.corun_mapping_path else {})
        logs = work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        # the workers' own lines (rank 0's progress, every rank's warnings) in this task's log every few seconds
        with LogRelay(logs / "workers.log", log, interval_s=PROGRESS_INTERVAL_S), sigterm_cancels_job():
            result = train_dlrover.logging_failures(store, run_id, scaler, run_training_job)(
                spec,
                shard_rows_from_manifest(manifest_dir),
                **tasks,
                resources=cfg.resources.model_copy(update={"workers": plan.workers,
                                                           "threads_per_worker": plan.threads_per_worker}),
                policy=StaticPolicy(cfg.resources.model_copy(update={"workers": plan.workers,
                                                                      "threads_per_worker": plan.threads_per_worker})),
                # torchrun restarts nothing itself: every relaunch goes through the job's failover policy (one budget)
                backend=LocalBackend(max_restarts=0, log_dir=logs, allocator=cfg.resources.allocator),
                state_dir=work / "master",  # an existing state file (a retried task) is resumed
                scaler=scaler,
                on_attempt=lambda a: _append(work / ATTEMPTS_FILE, {"task_pid": os.getpid(), **asdict(a)}),
            )
        dlrover = train_dlrover.finish(store, run_id, scaler, result.attempts, spec.output_dir)
        if mode == "offline":  # the preprocessed copy of the training data served this job only
            from recforge.pipelines.hooks.rap_training import (
                drop_offline_data,  # lazy: torch off the UI/CLI import path
            )
            drop_offline_data(store, run_id, w.tmp / "preprocessed")
        worker = WorkerResult.load(spec.output_dir)
        checkpoints = checkpoint_record(work, ck.every_steps, ck.flash, task_started=task["time"])
        kept = _keep_job_files(work, w.tmp / "job")  # the work dir goes after the commit; the evidence stays
        _log_shape(store, run_id, worker)
        store.log_metrics(run_id, {"samples_per_s": worker.samples_per_s, "wall_s": worker.wall_s,
                                   **({"final_train_loss": worker.final_loss} if worker.final_loss is not None else {}),
                                   **_checkpoint_metrics(checkpoints)})
        store.log_dict(run_id, checkpoints.model_dump(mode="json"), "checkpoints.json")
        store.log_dict(run_id, worker.model_dump(mode="json"), "result.json")
        from recforge.pipelines.hooks.rap_training import log_preprocessing  # lazy: torch off the UI/CLI path

        # mode and why, predicted vs measured step time, mapping imbalance; co-run: schedule, Gantt, timeline
        rap_schedule = log_preprocessing(store, run_id, plan, worker)
        executor = _executor_record(store, run_id, worker, offline_ran)
        log_prefetch(store, run_id, worker)
        log.info("checkpoints: %s", checkpoints.model_dump_json())
        return TrainOutputs(
            checkpoint_dir=str(w.final / "checkpoint"), samples_per_s=worker.samples_per_s, steps=worker.steps,
            wall_s=worker.wall_s, world_size=worker.world_size, samples_trained=worker.samples_per_epoch,
            job=JobRecord.model_validate(result).model_copy(update=kept), dlrover=dlrover, checkpoints=checkpoints,
            preprocessing=mode, rap_schedule=rap_schedule, executor=executor,
            warm_start=warm_start.confirm(warm, spec.output_dir, resumed=worker.resumed_from is not None),
        )

    out = run_stage(ctx, TrainOutputs, body)
    shutil.rmtree(work, ignore_errors=True)  # committed: nothing left to resume
    return out


def _preprocessing_mode(cfg, plan: PlanOutputs) -> str:
    """What the workers run: plan_resources' choice (config `preprocessing`, 'auto' resolved there)."""
    return plan.preprocessing.mode if plan.preprocessing is not None else cfg.preprocessing


def _executor_record(store, run_id: str, worker: WorkerResult, offline: dict[str, Any] | None) -> ExecutorRecord | None:
    """The preprocessing path that executed (the workers', or this task's offline pass), logged as params/tags."""
    ran = offline if offline is not None else (worker.executor.model_dump() if worker.executor else None)
    if ran is None:
        return None
    record = ExecutorRecord.model_validate(ran)
    fields = {"preprocess_executor_path": record.path, "native_kernels": str(record.native_kernels)}
    store.set_tags(run_id, fields)
    try:
        store.log_params(run_id, fields)
    except ValueError as e:  # a retried task whose earlier attempt logged another path: the tags hold this one
        log.warning("executor path params kept from an earlier attempt (%s)", e)
    store.log_dict(run_id, record.model_dump(mode="json"), "executor.json")
    log.info("preprocessing executed: %s (native kernels %s)", record.path, record.native_kernels)
    return record


def _log_shape(store, run_id: str, worker: WorkerResult) -> None:
    """Steps, world size and batch size the job ended with, as tags (always this attempt's) and params: a retried
    task whose job was rescaled (DLRover-RM) ends at another world size than an earlier attempt logged, and
    params are immutable, so the params keep the first attempt's values then."""
    fields = {"steps": worker.steps, "world_size": worker.world_size, "batch_size": worker.batch_size}
    store.set_tags(run_id, fields)
    try:
        store.log_params(run_id, fields)
    except ValueError as e:
        log.warning("job shape params kept from an earlier attempt (%s); the tags hold this attempt's", e)


def log_prefetch(store, run_id: str, worker: WorkerResult) -> None:
    """The prefetch depth the workers ran (WorkerResult.prefetch_steps: 0 under RAP co-run or the env override's
    value) as tag `prefetch_steps`: a tag, since a retried task may run another depth than an earlier attempt
    logged; the param `train.prefetch_steps` stays what was configured. Likewise tag `sparse_dist_pipeline`: whether
    the step loop ran TorchRec's TrainPipelineSparseDist, tag `prefetch_sched`: the prefetch thread's scheduling, and
    tag `allocator`: the ranks' allocator mode, tag `interaction`: how the dot interaction ran (cpp / torch /
    torchrec), tag `embedding_update`: which kernel updated the fused tables (cpp / fbgemm / mixed / none), tag
    `dense_sync`: what averaged the dense gradients (exchange / allreduce / none)."""
    if worker.prefetch_steps is not None:
        store.set_tags(run_id, {"prefetch_steps": worker.prefetch_steps})
    if worker.sparse_dist_pipeline is not None:
        store.set_tags(run_id, {"sparse_dist_pipeline": str(worker.sparse_dist_pipeline).lower()})
    if worker.prefetch_sched is not None:
        store.set_tags(run_id, {"prefetch_sched": worker.prefetch_sched})
    if worker.allocator is not None:
        store.set_tags(run_id, {"allocator": worker.allocator})
    if worker.interaction is not None:
        store.set_tags(run_id, {"interaction": worker.interaction})
    if worker.embedding_update is not None:
        store.set_tags(run_id, {"embedding_update": worker.embedding_update})
    if worker.dense_sync is not None:
        store.set_tags(run_id, {"dense_sync": worker.dense_sync})


def load_trained(ctx: RunContext):
    """The trained model, unsharded, with the plan it was trained on."""
    from recforge.train.recovery.checkpoint import load_unsharded  # lazy: torch off the UI/CLI import path

    plan_out = ctx.read(PlanOutputs)
    plan = Plan.load(Path(plan_out.plan_path))
    model = load_unsharded(ctx.config.model, plan_out.tables, plan_out.num_dense, ctx.read(TrainOutputs).checkpoint_dir,
                           plan=plan.model_dump(mode="json"))  # refuses a corrupt checkpoint or one of another plan
    return model.eval(), plan


# ---- the work dir -------------------------------------------------------------------------------------------------
def _fingerprint(cfg, data: IngestOutputs, plan: PlanOutputs) -> dict[str, Any]:
    """What a checkpoint in the work dir must have been trained on to be resumed."""
    return {"manifest_dir": str(data.train.manifest_dir), "plan_path": str(plan.plan_path),
            "train": cfg.train.model_dump(mode="json"), "model": cfg.model.model_dump(mode="json"),
            "dataset": cfg.dataset().model_dump(mode="json"), "seed": cfg.seed,
            "preprocessing": _preprocessing_mode(cfg, plan)}


def _open_work(work: Path, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Create or reopen the work dir for this task attempt; a work dir of another job is cleared (logged)."""
    job = work / JOB_FILE
    if job.exists():
        try:
            before = json.loads(job.read_text())
        except ValueError:
            before = None
        if before != fingerprint:
            changed = sorted(k for k in fingerprint if not isinstance(before, dict) or before.get(k) != fingerprint[k])
            log.warning("work dir %s holds another job's state (differs in %s): starting over", work, changed)
            shutil.rmtree(work)
    resumed = job.exists()
    work.mkdir(parents=True, exist_ok=True)
    job.write_text(json.dumps(fingerprint, indent=1))
    (work / PID_FILE).write_text(str(os.getpid()))
    task = {"pid": os.getpid(), "time": time.time(), "reopened": resumed}
    _append(work / TASKS_FILE, task)
    if resumed:
        steps = sorted(p.name for p in (work / "steps").glob("step-*")) if (work / "steps").exists() else []
        log.warning("resuming the job of an earlier attempt from %s (step checkpoints on disk: %s)", work,
                    steps or "none")
    return task


def _drop_dead_tmp_dirs(run_dir: Path) -> None:
    """`.train.tmp-<pid>` dirs of task processes that were killed (a live one is left alone)."""
    for d in run_dir.glob(".train.tmp-*"):
        try:
            pid = int(d.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _keep_job_files(work: Path, dest: Path) -> dict[str, Any]:
    """Copy the workers' log, the master's spec and state, the ledger and the events into the stage's dir; the
    JobRecord fields pointing at them."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("logs", "ledger"):
        if (work / name).exists():
            shutil.copytree(work / name, dest / name, dirs_exist_ok=True)
    for src in (work / "master" / "worker_spec.json", work / "master" / "master_state.json", work / EVENTS_FILE,
                work / ATTEMPTS_FILE, work / TASKS_FILE):
        if src.exists():
            shutil.copy2(src, dest / src.name)

    def there(p: Path) -> Path | None:
        return p if p.exists() else None

    return {"log_path": there(dest / "logs" / "workers.log"), "spec_path": there(dest / "worker_spec.json"),
            "state_file": there(dest / "master_state.json")}


def _append(path: Path, doc: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(doc, default=str) + "\n")


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # torn by a kill mid-write
            continue
    return out


# ---- the checkpoint record ----------------------------------------------------------------------------------------
def checkpoint_record(work: Path, every_steps: int, flash: bool, *, task_started: float) -> CheckpointRecord:
    """Checkpoints, their cost and what was resumed, over every group and task attempt of the job in `work`."""
    events = _read_lines(work / EVENTS_FILE)
    saves = [e for e in events if e["event"] == "checkpoint"]
    overhead = sum(float(e["stall_s"]) for e in saves)
    train_s: dict[int, float] = {}  # per generation: its training time (to its last event; a dead group's is less)
    for e in events:
        if "train_s" in e:
            train_s[e["generation"]] = max(train_s.get(e["generation"], 0.0), float(e["train_s"]))
    total = sum(train_s.values())
    starts = [e for e in events if e["event"] == "start"]
    tasks = _read_lines(work / TASKS_FILE)
    firsts = []  # each task attempt's first group start
    for t in tasks:
        first = next((e for e in starts if e["time"] >= t["time"]), None)
        if first is not None and first not in firsts:
            firsts.append(first)
    mine = next((e for e in starts if e["time"] >= task_started), None)  # this attempt's first group
    resumes = sum(1 for f in firsts[1:] if f.get("resumed_from_step") is not None)
    restarts = sum(1 for a in _read_lines(work / ATTEMPTS_FILE) if a.get("relaunched"))
    return CheckpointRecord(
        every_steps=every_steps, flash=flash, taken=len(saves), overhead_s=overhead,
        overhead_fraction=overhead / total if total > 0 else None,
        resumed_from_step=(mine or {}).get("resumed_from_step"),
        resumes=resumes, restarts=restarts, rows_retrained=_rows_retrained(work / "ledger"),
    )


def _rows_retrained(ledger: Path) -> int:
    if not ledger.exists():
        return 0
    from recforge.train.loop.ledger import rows_retrained  # lazy: only with a ledger

    try:
        return rows_retrained(ledger)  # counted per ledger entry: a day's rows are never expanded in memory
    except (FileNotFoundError, ValueError) as e:
        log.warning("ledger %s could not be audited: %s", ledger, e)
        return 0


def _checkpoint_metrics(c: CheckpointRecord) -> dict[str, float]:
    out = {"checkpoints_taken": c.taken, "checkpoint_overhead_s": c.overhead_s, "resumes": c.resumes,
           "restarts": c.restarts, "rows_retrained": c.rows_retrained}
    if c.overhead_fraction is not None:
        out["checkpoint_overhead_fraction"] = c.overhead_fraction
    if c.resumed_from_step is not None:
        out["resumed_from_step"] = c.resumed_from_step
    return out
