"""The rank's RAP side: the mapping it runs under, its co-run session, and each epoch's batch source by
spec.preprocessing (inline, corun, offline)."""
from __future__ import annotations

from pathlib import Path

import torch

from recforge.preprocess.executor import make_executor
from recforge.preprocess.executors.fused import FusedExecutor
from recforge.preprocess.planning.compiler import CompiledPlan
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.mapped_input import MappedInput
from recforge.rap.mapping.worker_mapping import WorkerMapping, load_mapping, mapped_jobs
from recforge.rap.planning.schedule import CorunSchedule, whole_kernel_schedule
from recforge.rap.runtime.offline import OfflineTaskBatches
from recforge.rap.runtime.session import CorunSession
from recforge.train.loop.batches import TaskBatches
from recforge.train.sharding import ShardedModel
from recforge.train.spec import WorkerSpec


def worker_mapping(spec: WorkerSpec, world_size: int, rank: int) -> WorkerMapping | None:
    """The mapping a worker runs under (spec.preprocessing 'corun' with a mapping file), else None."""
    if spec.preprocessing != "corun" or spec.corun_mapping_path is None:
        return None
    return load_mapping(spec.corun_mapping_path, world_size, rank, dim=spec.model.embedding_dim)


def load_schedule(path: str | Path | None, compiled: CompiledPlan, stage: str = "mlp_bwd") -> CorunSchedule:
    """The planned schedule, or (no path) every kernel whole in `stage`."""
    if path is None:
        return whole_kernel_schedule(compiled, stage, meta={"source": f"worker default: every kernel in {stage!r}"})
    return CorunSchedule.from_json(Path(path).read_text())


def start_session(spec: WorkerSpec, plan: Plan, sharded: ShardedModel, device: torch.device,
                  mapping: WorkerMapping | None = None, rank: int = 0, world_size: int = 1,
                  batch_size: int | None = None) -> CorunSession | None:
    """The worker's CorunSession for spec.preprocessing == 'corun', else None; with an executed `mapping` RAP's
    mapped co-run over local batches of `batch_size` rows."""
    if spec.preprocessing != "corun":
        return None
    if mapping is not None and mapping.executed:
        return mapped_session(spec, plan, sharded, mapping, device, rank, world_size, batch_size or mapping.batch_size)
    executor = make_executor("fused", plan, spec.dataset)
    if not isinstance(executor, FusedExecutor):  # make_executor("fused") builds one: the schedule needs its plan
        raise TypeError(f"make_executor('fused') built a {type(executor).__name__}, not a FusedExecutor")
    schedule = load_schedule(spec.corun_schedule_path, executor.compiled)
    return CorunSession(plan, spec.dataset, schedule, sharded.model, device, threads=spec.corun_threads,
                        sharding=sharded.plan_summary(), executor=executor)


def mapped_session(spec: WorkerSpec, plan: Plan, sharded: ShardedModel, mapping: WorkerMapping, device: torch.device,
                   rank: int, world_size: int, batch_size: int) -> CorunSession:
    """The worker's CorunSession under the mapping (its sharded model already placed by mapping.placements)."""
    mapped = MappedInput.install(sharded.model, rank, world_size)
    return CorunSession(plan, spec.dataset, None, sharded.model, device, threads=spec.corun_threads,
                        sharding=sharded.plan_summary(),
                        jobs=mapped_jobs(plan, spec.dataset, mapping, rank, batch_size), mapped=mapped)


def epoch_source(spec: WorkerSpec, corun: CorunSession | None, client, executor, batch_size: int,
                 device: torch.device, ledger=None):
    """One epoch's batches by spec.preprocessing: inline (TaskBatches), corun (the session's), offline (the rows
    preprocessed before training, spec.preprocessed_dir)."""
    if corun is not None:
        return corun.batches(client, spec.manifest_dir, spec.dataset, batch_size, device, ledger)
    if spec.preprocessing == "offline":
        if spec.preprocessed_dir is None:  # WorkerSpec's validator requires it; a spec changed after validation
            raise ValueError("preprocessed_dir: required when preprocessing is 'offline'")
        return OfflineTaskBatches(client, spec.preprocessed_dir, spec.dataset, batch_size, device, ledger=ledger)
    return TaskBatches(client, spec.manifest_dir, spec.dataset, executor, batch_size, device, ledger=ledger)
