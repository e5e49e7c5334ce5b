"""One rank's training run: composes the model and its sharding, the elastic client, recovery (step checkpoints,
resume), RAP's co-run and the step loop.

Trains the spec's DLRM with DMP over the job master's data-shard tasks, writes a DCP checkpoint to
spec.checkpoint_dir, and on rank 0 output_dir/result.json + probe.pt.

Recovery (spec.recovery, recforge.train.recovery.restart): a group first loads the newest usable step checkpoint
(any world size) and rolls the job master back to the data state stored with it; it takes step checkpoints (flash
or disk) at logging-window boundaries; a stop command from the master (rescale) checkpoints and returns None.
Rank 0 appends group starts, checkpoints and the finish to recovery.events_file, and logs MLflow metrics only at
steps after the last one an earlier group of the run logged (a resumed group re-trains steps a dead one logged).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from recforge.elastic.allocator_env import ALLOCATOR_ENV, allocator_mode
from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors import record as executed_paths
from recforge.preprocess.planning.plan import Plan
from recforge.train.loop.accumulate import train_epoch_accumulated
from recforge.train.loop.batches import empty
from recforge.train.loop.ledger import Ledger
from recforge.train.loop.pipelined import PIPELINE_ENV, pipeline_override
from recforge.train.loop.prefetch import PrefetchBatches
from recforge.train.loop.step_loop import (
    EpochStats,
    Heartbeat,
    LoopState,
    PhaseTimes,
    pipeline_applies,
    train_epoch,
)
from recforge.train.loop.window import GroupStop, WindowHook
from recforge.train.metrics_sink import AsyncMetricsSink, LogFn
from recforge.train.model import build_dlrm, interaction_kind
from recforge.train.probe import probe_logits
from recforge.train.recovery.checkpoint import save_checkpoint
from recforge.train.recovery.checkpointer import Checkpointer
from recforge.train.recovery.flash import agent_present
from recforge.train.recovery.layout import fingerprint
from recforge.train.recovery.restart import resume_group
from recforge.train.result import ExecutedPreprocessing, ResumedFrom, WorkerResult
from recforge.train.sharding import shard_model
from recforge.train.spec import WorkerSpec
from recforge.worker.corun import epoch_source, start_session, worker_mapping
from recforge.worker.elastic_client import join_master, launch_generation
from recforge.worker.init_checkpoint import load_init_checkpoint

log = logging.getLogger(__name__)

PROBE_FILE = "probe.pt"
# overrides train.prefetch_steps (profiling without a new config); the result records the depth that ran
PREFETCH_ENV = "RECFORGE_TRAIN_PREFETCH"
# overrides train.prefetch_sched, the prefetch thread's scheduling (idle: SCHED_IDLE, or normal; the A/B)
PREFETCH_SCHED_ENV = "RECFORGE_PREFETCH_SCHED"
PREFETCH_SCHEDS = ("idle", "normal")
PHASES_ENV = "RECFORGE_STEP_PHASES"  # a directory: each rank writes its step loop's time per phase there (profiling)
# with the prefetch thread, the training thread waits for the GIL after each C++ op the thread overlapped; Python's
# default 5 ms switch interval would add up to that per wait (the convoy effect), so the worker switches faster
PREFETCH_SWITCH_INTERVAL_S = 0.0005


def prefetch_depth(spec: WorkerSpec, corun: bool) -> int:
    """Steps a rank prepares ahead (PrefetchBatches; 0: the synchronous loop): spec.train.prefetch_steps, or env
    RECFORGE_TRAIN_PREFETCH where set; always 0 with RAP's co-run, whose source reads ahead itself."""
    if corun:
        return 0
    raw = os.environ.get(PREFETCH_ENV, "").strip()
    if not raw:
        return spec.train.prefetch_steps
    try:
        depth = int(raw)
    except ValueError:
        depth = -1
    if depth < 0:
        raise ValueError(f"{PREFETCH_ENV}={raw!r}: expected a step count >= 0 (it overrides train.prefetch_steps)")
    if depth != spec.train.prefetch_steps:
        log.warning("%s=%d overrides train.prefetch_steps=%d", PREFETCH_ENV, depth, spec.train.prefetch_steps)
    return depth


def prefetch_sched(spec: WorkerSpec) -> str:
    """The prefetch thread's scheduling: spec.train.prefetch_sched ("idle" by default, or "normal"), or env
    RECFORGE_PREFETCH_SCHED where set."""
    raw = os.environ.get(PREFETCH_SCHED_ENV, "").strip()
    if not raw:
        return spec.train.prefetch_sched
    if raw not in PREFETCH_SCHEDS:
        raise ValueError(f"{PREFETCH_SCHED_ENV}={raw!r}: expected one of {list(PREFETCH_SCHEDS)} (it overrides "
                         "train.prefetch_sched)")
    if raw != spec.train.prefetch_sched:
        log.warning("%s=%s overrides train.prefetch_sched=%s", PREFETCH_SCHED_ENV, raw, spec.train.prefetch_sched)
    return raw


def allocator_ran() -> Literal["kept", "system"] | None:
    """The allocator mode this rank was launched with (recforge.elastic.allocator_env; read by glibc at start):
    None where no recforge backend launched it."""
    return allocator_mode(os.environ) if os.environ.get(ALLOCATOR_ENV) else None


def sparse_dist_pipeline(spec: WorkerSpec, rank: int) -> bool:
    """Whether to run the pipelined step loop where it applies: spec.train.sparse_dist_pipeline, or env
    RECFORGE_TRAIN_PIPELINE where set."""
    override = pipeline_override()
    if override is None:
        return spec.train.sparse_dist_pipeline
    if override != spec.train.sparse_dist_pipeline and rank == 0:
        log.warning("%s overrides train.sparse_dist_pipeline=%s", PIPELINE_ENV, spec.train.sparse_dist_pipeline)
    return override


def tracking_log_fn() -> LogFn | None:
    """recforge.tracking.metrics.log_metrics, or None where tracking is not available."""
    try:
        from recforge.tracking.metrics import log_metrics  # lazy: mlflow, needed on rank 0 of a tracked run only
    except ImportError as e:
        log.debug("recforge.tracking unavailable (%s): not logging metrics", e)
        return None
    return log_metrics


def _metrics_sink(spec: WorkerSpec) -> AsyncMetricsSink | None:
    """An AsyncMetricsSink bound to the spec's MLflow run, or None (no run id / no tracking module)."""
    if not spec.mlflow_run_id or not spec.tracking_uri:  # WorkerSpec requires a tracking_uri with a run id
        return None
    fn = tracking_log_fn()
    return AsyncMetricsSink(fn, spec.tracking_uri, spec.mlflow_run_id) if fn is not None else None


def last_logged_step(spec: WorkerSpec) -> int | None:
    """The highest train_loss step already in the spec's MLflow run (None: none, or no tracking)."""
    if not spec.mlflow_run_id or not spec.tracking_uri:
        return None
    try:
        from recforge.tracking.metrics import last_logged_step as last  # lazy: mlflow, rank 0 of a tracked run only
        return last(spec.tracking_uri, spec.mlflow_run_id, "train_loss")
    except Exception as e:  # tracking trouble must not kill a training job
        log.warning("could not read the run's logged steps (%r): metrics may repeat steps", e)
        return None


class AfterStep:
    """A metrics sink that drops steps up to `after`: an earlier group of this run logged those (its lost timeline)."""

    def __init__(self, sink: AsyncMetricsSink, after: int | None) -> None:
        self.sink, self.after = sink, after

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        if self.after is None or step > self.after:
            self.sink(metrics, step)

    def close(self) -> None:
        self.sink.close()


class Events:
    """Rank 0's append-only record of group starts, step checkpoints and finishes (recovery.events_file)."""

    def __init__(self, path: Path | None, rank: int, generation: int) -> None:
        self.path = Path(path) if path is not None and rank == 0 else None
        self.generation = generation
        self.t_train: float | None = None  # set when the training loop starts

    def train_s(self) -> float:
        return time.perf_counter() - self.t_train if self.t_train is not None else 0.0

    def add(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"event": event, "generation": self.generation, "time": time.time(), **fields})
        with open(self.path, "a") as f:
            f.write(line + "\n")


class RecordedCheckpointer(Checkpointer):
    """A Checkpointer whose saves go to the events file with their stall."""

    events: Events

    def save(self, state: LoopState, current: EpochStats | None, progress: dict[str, int]) -> Path:
        path = super().save(state, current, progress)
        self.events.add("checkpoint", step=state.step, stall_s=self.stalls_s[-1], train_s=self.events.train_s(),
                        kind="memory" if self.memory_root is not None else "disk")
        return path


def run(spec: WorkerSpec, rank: int, world_size: int, device: torch.device) -> WorkerResult | None:
    """Train this rank; rank 0 returns (and writes) the result, other ranks and a stopped group return None."""
    t_start = time.perf_counter()
    # first: a bad RECFORGE_TRAIN_PREFETCH fails before the master is joined; RAP's co-run reads ahead itself (0)
    depth = prefetch_depth(spec, corun=spec.preprocessing == "corun")
    rec = spec.recovery
    generation = launch_generation(spec)
    accumulation = rec.grad_accumulation
    per_rank = rank_step_rows(spec, world_size)
    plan = Plan.load(spec.plan_path)
    tables, num_dense = plan.tables(), len(plan.dense_features())
    # what every checkpoint of this run holds: loaders refuse one of another model or plan (layout.check_compatible)
    model_fingerprint = fingerprint(spec.model.model_dump(mode="json"), tables, num_dense, plan.model_dump(mode="json"))
    torch.manual_seed(spec.seed)
    model = build_dlrm(spec.model, tables, num_dense, device, fused=spec.train.fused_interaction)
    interaction = interaction_kind(model, device)  # builds the C++ kernel here (once per machine), not in step 1
    mapping = worker_mapping(spec, world_size, rank)  # RAP's mapping (co-run with a planned mapping), else None
    # (planned for another world size: its tables' kinds on this one, not executed; the checkpoint's states match)
    sharded = shard_model(model, spec.train, world_size=world_size, device=device,
                          placements=mapping.placements if mapping is not None else None)
    executor = make_executor(spec.preprocess_executor, plan, spec.dataset)  # PipelineConfig.preprocess_executor
    bs = spec.train.batch_size
    micro = per_rank // accumulation  # rows per forward; a step is `accumulation` of them on every rank
    zero_batch = empty(spec.dataset, micro, executor, device)

    client = join_master(spec, rank, generation)
    disk_root = rec.steps_root(spec.checkpoint_dir)
    memory_root = rec.shm_root(spec.checkpoint_dir)
    start = resume_group(sharded.model, sharded.optimizer, client, rank=rank, disk_root=disk_root,
                         memory_root=memory_root if rec.flash else None, reason=f"generation {generation} starts",
                         fingerprint=model_fingerprint)
    state, restored = start.state, start.restored
    if restored is None and spec.init_checkpoint is not None:  # warm start; the run's own checkpoint comes first
        load_init_checkpoint(sharded.model, sharded.optimizer, spec.init_checkpoint, rank=rank,
                             world_size=world_size, output_dir=spec.output_dir)
    events = Events(rec.events_file, rank, generation)
    events.add("start", world_size=world_size, step=state.step, resumed_from_step=restored.step if restored else None,
               source=restored.source if restored else None)
    ledger = None
    if rec.ledger_dir is not None:
        ledger = Ledger(rec.ledger_dir, generation, rank, since=state.step)
        if rank == 0:
            ledger.start(restored.step if restored else None, restored.meta.get("generation") if restored else None,
                         world_size)
    flash = rec.flash and agent_present(rec.flash_agent)
    if rec.flash and not flash and rank == 0:
        log.warning("recovery.flash is set but no flash agent runs (%s unset): checkpoints go to disk synchronously",
                    "RECFORGE_FLASH_AGENT")
    summary_plan = sharded.plan_summary()
    checkpointer = RecordedCheckpointer(
        sharded.model, sharded.optimizer, client, rank=rank, world_size=world_size, generation=generation,
        every_steps=rec.checkpoint_every_steps, disk_root=disk_root, memory_root=memory_root if flash else None,
        keep=rec.keep_checkpoints, ledger=ledger, last_step=state.step,
        extra_meta=lambda: {"sharding_plan": summary_plan, "batch_size": bs, "grad_accumulation": accumulation,
                            "fingerprint": model_fingerprint},
    )
    checkpointer.events = events
    current: dict[str, Any] = {"source": None}
    hook = WindowHook(checkpointer, client, lambda: current["source"].progress() if current["source"] else {},
                      rank=rank, generation=generation, micro_batch=micro)
    heartbeat = Heartbeat(client, interval_s=min(10.0, spec.train.lease_timeout_s / 4))
    async_sink = _metrics_sink(spec) if rank == 0 else None
    # connects to the tracking store before the clock starts; steps up to this one were logged by a dead group
    sink = AfterStep(async_sink, last_logged_step(spec)) if async_sink is not None else None
    samples_before = sum(e.samples for e in state.epochs) + (start.current.samples if start.current else 0)
    corun = start_session(spec, plan, sharded, device, mapping=mapping, rank=rank, world_size=world_size,
                          batch_size=micro)  # RAP co-running, else None; created last: the try below closes it
    # the prefetch thread's per-step all_reduce runs on its own gloo group, beside the model's collectives
    side_group = dist.new_group(backend="gloo") if depth and world_size > 1 else None
    sched = prefetch_sched(spec)  # a bad value fails here, before training
    ran_sched: str | None = None  # what the prefetch thread ran under (None: no prefetch thread)
    if depth:
        sys.setswitchinterval(PREFETCH_SWITCH_INTERVAL_S)
    phases = PhaseTimes() if os.environ.get(PHASES_ENV) else None
    pipeline_wanted = sparse_dist_pipeline(spec, rank)
    ran_pipelined = False
    ran_before = executed_paths.mark()  # the executor path is counted over the training batches only
    t_train = events.t_train = time.perf_counter()
    try:
        for epoch in range(start.start_epoch, spec.train.epochs):
            client.epoch = epoch
            source = epoch_source(spec, corun, client, executor, micro, device, ledger)  # by spec.preprocessing
            if depth:  # lease, read, preprocess and the step's counts ahead; done reports off the step's path
                # the steps prepared ahead are counted in one side all_reduce (they all are on every rank)
                source = PrefetchBatches(source, accumulation=accumulation, depth=depth, group=side_group,
                                         world_size=world_size, idle_priority=sched == "idle",
                                         counts_per_reduce=depth)
            current["source"] = source
            resume = start.current if start.current is not None and start.current.epoch == epoch else None
            common: dict[str, Any] = dict(epoch=epoch, world_size=world_size, log_every=spec.train.log_every,
                                          heartbeat=heartbeat, sink=sink, rank=rank, resume=resume, on_window=hook,
                                          phases=phases)
            pipelined = pipeline_wanted and pipeline_applies(sharded, source, accumulation)
            if pipeline_wanted and not pipelined and rank == 0:
                log.warning("train.sparse_dist_pipeline is on but does not apply to epoch %d (it needs prefetch_steps "
                            ">= 1, one micro-batch per step and no RAP co-run): the plain step loop runs", epoch)
            ran_pipelined = ran_pipelined or pipelined
            if accumulation == 1:
                train_epoch(sharded, source, zero_batch, state, pipelined=pipelined, **common)
            else:
                train_epoch_accumulated(sharded, source, zero_batch, state, accumulation=accumulation, **common)
    except GroupStop as stop:
        if rank == 0:
            log.warning("generation %d stops at step %d: %s", generation, state.step, stop)
        events.add("stop", step=state.step, train_s=events.train_s())
        if sink is not None:
            sink.close()
        client.close()
        return None
    finally:
        if isinstance(current["source"], PrefetchBatches):  # a stop or failure mid-epoch: send what was trained
            try:
                current["source"].close()
            except Exception as e:  # the original error (if any) is the one to raise
                log.warning("prefetch thread: %r", e)
        if ledger is not None:
            ledger.close()
        if corun is not None:
            corun.close()
    train_wall = time.perf_counter() - t_train
    if isinstance(current["source"], PrefetchBatches):  # idle_priority is False where SCHED_IDLE could not be set
        ran_sched = "idle" if current["source"].idle_priority else "normal"
    if phases is not None:
        write_phases(Path(os.environ[PHASES_ENV]), rank, phases, train_wall, current["source"])
    executed = executed_paths.summarize(spec.preprocess_executor, executed_paths.since(ran_before),
                                        preprocessing=spec.preprocessing, generation=generation, rank=rank)
    if rank == 0:
        log.info("preprocessing executed: %s (native kernels: %s)", executed["path"], executed["native_kernels"])
    events.add("finish", step=state.step, train_s=train_wall)
    client.close()

    probe = probe_logits(sharded.model, spec.manifest_dir, spec.dataset, executor, micro, device)
    summary = sharded.plan_summary()
    meta = {"world_size": world_size, "sharding_plan": summary, "model": spec.model.model_dump(mode="json"),
            "tables": tables, "num_dense": num_dense, "steps": state.step, "fingerprint": model_fingerprint}
    save_checkpoint(sharded.model, sharded.optimizer, spec.checkpoint_dir, rank=rank, meta=meta)
    peak_rss = gather_peak_rss(world_size)  # every rank: DLRover-RM fits its memory model on these
    if rank != 0:
        return None
    samples = sum(e.samples for e in state.epochs) - samples_before  # trained by this group
    result = WorkerResult(
        world_size=world_size,
        steps=state.step,
        epochs=[e.epoch for e in state.epochs],
        samples_per_epoch=[e.samples for e in state.epochs],
        loss_per_epoch=[e.loss for e in state.epochs],
        final_loss=state.epochs[-1].loss if state.epochs else None,
        wall_s=time.perf_counter() - t_start,
        train_wall_s=train_wall,
        samples_per_s=samples / train_wall if train_wall > 0 else 0.0,
        batch_size=bs,
        threads_per_worker=spec.threads_per_worker,
        fused_embeddings=spec.train.fused_embeddings,
        sharding_plan=summary,
        checkpoint_dir=str(spec.checkpoint_dir),
        probe={k: v for k, v in probe.items() if k != "logits"},
        generation=generation,
        resumed_from=(ResumedFrom(path=str(restored.path), step=restored.step, source=restored.source,
                                  saved_by_generation=restored.meta.get("generation"),
                                  saved_at_world_size=restored.meta.get("world_size"), skipped=restored.skipped)
                      if restored is not None else None),
        checkpoints=checkpointer.summary(),
        grad_accumulation=accumulation,
        micro_batch_size=micro,
        rows_per_rank_step=per_rank,
        global_batch=per_rank * world_size,
        rap=corun.summary() if corun is not None else None,
        executor=ExecutedPreprocessing.model_validate(executed),
        peak_rss_bytes=peak_rss,
        prefetch_steps=depth,
        prefetch_sched=ran_sched,
        sparse_dist_pipeline=ran_pipelined,
        allocator=allocator_ran(),
        interaction=interaction,
        embedding_update=sharded.embedding_update,
        dense_sync=sharded.dense_sync,
    )
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(probe, out / PROBE_FILE)
    if sink is not None:  # the end of the lineage: logged at its step whatever a dead group logged
        sink.sink({"final_train_loss": result.final_loss or float("nan"),
                   "train_samples_per_s": result.samples_per_s}, state.step)
        sink.close()
    result.save(out)
    log.info("result: %s",
             result.model_dump_json(include={"steps", "samples_per_epoch", "final_loss", "samples_per_s"}))
    return result


def rank_step_rows(spec: WorkerSpec, world_size: int) -> int:
    """Rows one rank trains per optimizer step: its share of recovery.global_batch (kept across rescales),
    else train.batch_size; split into recovery.grad_accumulation equal micro-batches."""
    rec = spec.recovery
    rows = spec.train.batch_size if rec.global_batch is None else rec.global_batch // world_size
    if rec.global_batch is not None and rec.global_batch % world_size:
        raise ValueError(f"recovery.global_batch={rec.global_batch} is not divisible by the world size {world_size}")
    if rows % rec.grad_accumulation:
        raise ValueError(f"recovery.grad_accumulation={rec.grad_accumulation} does not divide the {rows} rows a rank "
                         f"trains per step")
    return rows


def gather_peak_rss(world_size: int) -> list[float]:
    """Every rank's peak resident memory in bytes (VmHWM; ru_maxrss where /proc is missing), by rank."""
    import resource  # lazy: only at the end of a run

    try:
        with open("/proc/self/status") as f:
            mine = next(float(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mine = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux
    if world_size == 1 or not torch.distributed.is_initialized():
        return [mine]
    out: list[float | None] = [None] * world_size
    torch.distributed.all_gather_object(out, mine)
    return [float(v or 0.0) for v in out]


def write_phases(root: Path, rank: int, phases: PhaseTimes, train_wall_s: float, source: Any) -> None:
    """This rank's step-loop time per phase (and the prefetch thread's) as <root>/phases_rank<r>.json."""
    doc: dict[str, Any] = {"rank": rank, "train_wall_s": train_wall_s, **phases.to_dict()}
    if isinstance(source, PrefetchBatches):
        doc["prefetch_thread_s"] = dict(source.thread_s)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".phases_rank{rank}.json.tmp"
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, root / f"phases_rank{rank}.json")
