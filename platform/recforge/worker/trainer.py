"""One rank's training run: composes the model and its sharding, the elastic client, recovery (step checkpoints,
resume), RAP's co-run and the step loop.

Trains the spec's DLRM with DMP over the job master's data-shard tasks, writes a DCP checkpoint to
spec.checkpoint_dir, and on rank 0 output_dir/result.json + probe.pt.

Recovery (spec.recovery, recforge.train.recovery.restart): a group first loads the newest usable step checkpoint
(any world size) and rolls the job master back to the data state stored with it; it takes step checkpoints (flash
or disk) at logging-window boundaries; a stop command from the master (rescale) checkpoints and returns None.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from recforge.preprocess.executor import make_executor
from recforge.preprocess.planning.plan import Plan
from recforge.train.loop.accumulate import train_epoch_accumulated
from recforge.train.loop.batches import empty
from recforge.train.loop.ledger import Ledger
from recforge.train.loop.step_loop import Heartbeat, train_epoch
from recforge.train.loop.window import GroupStop, WindowHook
from recforge.train.metrics_sink import AsyncMetricsSink, LogFn
from recforge.train.model import build_dlrm
from recforge.train.probe import probe_logits
from recforge.train.recovery.checkpoint import save_checkpoint
from recforge.train.recovery.checkpointer import Checkpointer
from recforge.train.recovery.flash import agent_present
from recforge.train.recovery.restart import resume_group
from recforge.train.result import ResumedFrom, WorkerResult
from recforge.train.sharding import shard_model
from recforge.train.spec import WorkerSpec
from recforge.worker.corun import epoch_source, start_session, worker_mapping
from recforge.worker.elastic_client import join_master, launch_generation

log = logging.getLogger(__name__)

PROBE_FILE = "probe.pt"


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


def run(spec: WorkerSpec, rank: int, world_size: int, device: torch.device) -> WorkerResult | None:
    """Train this rank; rank 0 returns (and writes) the result, other ranks and a stopped group return None."""
    t_start = time.perf_counter()
    rec = spec.recovery
    generation = launch_generation(spec)
    accumulation = rec.grad_accumulation
    per_rank = rank_step_rows(spec, world_size)
    plan = Plan.load(spec.plan_path)
    tables, num_dense = plan.tables(), len(plan.dense_features())
    torch.manual_seed(spec.seed)
    model = build_dlrm(spec.model, tables, num_dense, device)
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
                         memory_root=memory_root if rec.flash else None, reason=f"generation {generation} starts")
    state, restored = start.state, start.restored
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
    checkpointer = Checkpointer(
        sharded.model, sharded.optimizer, client, rank=rank, world_size=world_size, generation=generation,
        every_steps=rec.checkpoint_every_steps, disk_root=disk_root, memory_root=memory_root if flash else None,
        keep=rec.keep_checkpoints, ledger=ledger, last_step=state.step,
        extra_meta=lambda: {"sharding_plan": summary_plan, "batch_size": bs, "grad_accumulation": accumulation},
    )
    current: dict[str, Any] = {"source": None}
    hook = WindowHook(checkpointer, client, lambda: current["source"].progress() if current["source"] else {},
                      rank=rank, generation=generation, micro_batch=micro)
    heartbeat = Heartbeat(client, interval_s=min(10.0, spec.train.lease_timeout_s / 4))
    sink = _metrics_sink(spec) if rank == 0 else None
    if sink is not None:  # connect to the tracking store before the clock starts
        sink.log_now({"world_size": float(world_size), "batch_size": float(bs)}, 0)
    samples_before = sum(e.samples for e in state.epochs) + (start.current.samples if start.current else 0)
    corun = start_session(spec, plan, sharded, device, mapping=mapping, rank=rank, world_size=world_size,
                          batch_size=micro)  # RAP co-running, else None; created last: the try below closes it
    t_train = time.perf_counter()
    try:
        for epoch in range(start.start_epoch, spec.train.epochs):
            client.epoch = epoch
            source = epoch_source(spec, corun, client, executor, micro, device, ledger)  # by spec.preprocessing
            current["source"] = source
            resume = start.current if start.current is not None and start.current.epoch == epoch else None
            common: dict[str, Any] = dict(epoch=epoch, world_size=world_size, log_every=spec.train.log_every,
                                          heartbeat=heartbeat, sink=sink, rank=rank, resume=resume, on_window=hook)
            if accumulation == 1:
                train_epoch(sharded, source, zero_batch, state, **common)
            else:
                train_epoch_accumulated(sharded, source, zero_batch, state, accumulation=accumulation, **common)
    except GroupStop as stop:
        if rank == 0:
            log.warning("generation %d stops at step %d: %s", generation, state.step, stop)
        if sink is not None:
            sink.close()
        client.close()
        return None
    finally:
        if ledger is not None:
            ledger.close()
        if corun is not None:
            corun.close()
    train_wall = time.perf_counter() - t_train
    client.close()

    probe = probe_logits(sharded.model, spec.manifest_dir, spec.dataset, executor, micro, device)
    summary = sharded.plan_summary()
    meta = {"world_size": world_size, "sharding_plan": summary, "model": spec.model.model_dump(mode="json"),
            "tables": tables, "num_dense": num_dense, "steps": state.step}
    save_checkpoint(sharded.model, sharded.optimizer, spec.checkpoint_dir, rank=rank, meta=meta)
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
    )
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(probe, out / PROBE_FILE)
    if sink is not None:
        sink({"final_train_loss": result.final_loss or float("nan"),
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
