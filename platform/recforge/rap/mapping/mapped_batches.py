"""A rank's batches under RAP's mapping: every rank steps through the same global batches, each preprocessing
its share (RAP's mapping, docs/rap.md).

Global batch k of a task = its rows [k*W*B, (k+1)*W*B); rank r trains rows [k*W*B + r*B, k*W*B + (r+1)*B) of it
(padded to B with zero-weight rows). Rank r preprocesses
  - the dense features and the data_parallel tables' features over those B local rows (the "local" plan), and
  - the features of the tables it holds (table_wise / column_wise) over the global batch: every rank's padded
    local batch, concatenated in rank order (the "global" plan) - the ids torchrec's input all-to-all would
    have delivered, so recforge.rap.mapping.mapped_input skips that all-to-all.
The ranks take turns leasing the data-shard tasks from the master (task k: rank k mod W), and the leaser
broadcasts each to the others (one small broadcast per task, not per step); every rank reads the task's rows from
the shared shards. The leaser reports the task done and holds its progress for checkpoints, so the master sees
every worker train and renew leases at the same rate (DLRover's straggler rule compares them). Each rank's ledger
records the rows it trained, so every row is still trained exactly once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import DatasetConfig
from recforge.preprocess.batch import RawBatch
from recforge.rap.mapping.mapped_input import MappedFeatures
from recforge.rap.runtime.corun_batches import CorunBatch, CorunReadAhead
from recforge.rap.runtime.corun_runtime import CorunConfigError, CorunRuntime
from recforge.train.loop.batches import Batch, LeasedTask, TaskBatches, TaskClient, slice_raw


class LeaseFailed(str):
    """What the leasing rank broadcasts instead of a task when its lease raised."""


@dataclass
class MappedRaw:
    local: RawBatch  # this rank's rows, padded to B
    global_: RawBatch  # every rank's padded rows, rank order (W*B)
    weights: torch.Tensor
    real: int


class MappedTaskBatches(TaskBatches):
    """TaskBatches over global batches; `local_executor` / `global_executor` run the rank's local / global plans
    (recforge.rap.mapping.milp.split_rank_plan) inline; `global_executor` is None on a rank holding no table."""

    def __init__(self, client: TaskClient, manifest_dir: str | Path, dataset: DatasetConfig, local_executor,
                 global_executor, batch_size: int, device: torch.device, rank: int, world_size: int,
                 ledger=None) -> None:
        super().__init__(client, manifest_dir, dataset, local_executor, batch_size, device, ledger=ledger)
        self.local_executor, self.global_executor = local_executor, global_executor
        self.rank, self.world_size = rank, world_size
        self._leases = 0  # lease turns taken so far (the same count on every rank)
        self._leaser: dict[str, int] = {}  # task id -> the rank that leased it (this epoch's tasks)

    # ------------------------------------------------------------------ batches

    def next(self) -> Batch | None:
        if not self.hold_task():
            return None
        w, b, r = self.world_size, self.batch_size, self.rank
        _, rows = self.held()
        start, end = self._offset, min(self._offset + w * b, rows.rows)
        self._offset = end
        slices = [(min(start + k * b, end), min(start + (k + 1) * b, end)) for k in range(w)]
        padded = [slice_raw(rows, a, z).pad_to(b) for a, z in slices]
        mine_a, mine_z = slices[r]
        raw = MappedRaw(local=padded[r][0], global_=RawBatch.concat([p for p, _ in padded]), weights=padded[r][1],
                        real=mine_z - mine_a)
        return self.stamp(self.prepare_mapped(raw), mine_a, mine_z, last=end >= rows.rows)

    def prepare_mapped(self, raw: MappedRaw) -> Batch:
        """Preprocess now (inline); the co-run source overrides it to launch the kernels into the next step."""
        dense, local_kjt = self.local_executor(raw.local.to(self.device))
        global_kjt = self.global_executor(raw.global_.to(self.device))[1] if self.global_executor else None
        return Batch(dense=dense, sparse=self.features(local_kjt, global_kjt), labels=raw.local.label.to(self.device),
                     weights=raw.weights.to(self.device), real=raw.real)

    def features(self, local_kjt: KeyedJaggedTensor | None, global_kjt: KeyedJaggedTensor | None) -> MappedFeatures:
        if local_kjt is not None and not local_kjt.keys():
            local_kjt = None
        return MappedFeatures(local=local_kjt, global_=global_kjt, batch_size=self.batch_size)

    # ------------------------------------------------------------------ tasks

    def reports(self, task_id: str) -> bool:
        """The rank that leased the task reports it done and holds its progress (every rank is at its offset)."""
        return self._leaser.get(task_id) == self.rank

    def lease_task(self) -> LeasedTask | None:
        """Rank (turn mod W) leases, the others receive the task (or None) from its broadcast."""
        src = self._leases % self.world_size
        self._leases += 1
        box: list = [None]
        if self.rank == src:
            try:
                box[0] = self.client.lease()
            except Exception as e:  # the others wait in the broadcast: tell them, then raise everywhere
                box[0] = LeaseFailed(f"rank {src} could not lease a task: {type(e).__name__}: {e}")
                if self.world_size > 1:
                    dist.broadcast_object_list(box, src=src)
                raise
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=src)
        task = box[0]
        if isinstance(task, LeaseFailed):
            raise RuntimeError(str(task))
        if task is not None:
            self._leaser[task.task_id] = src
        return task


class MappedCorunBatches(CorunReadAhead, MappedTaskBatches):
    """RAP co-run under the mapping: batch i+1's global and local plans run as the runtime's two jobs (global
    first, when this rank holds a table) inside step i's stages (recforge.rap.runtime.corun_runtime)."""

    def __init__(self, client: TaskClient, manifest_dir: str | Path, dataset: DatasetConfig, runtime: CorunRuntime,
                 batch_size: int, device: torch.device, rank: int, world_size: int, ledger=None,
                 step_boundary: Callable[[], None] | None = None, step_done: Callable[[], None] | None = None) -> None:
        names = runtime.job_names()
        if names not in (["global", "local"], ["local"]):
            raise CorunConfigError(f"mapped co-run: runtime jobs {names}; expected ['global', 'local'] or ['local'] "
                                   "(recforge.rap.planning.scheduler.mapped_rank_schedules)")
        self._has_global = names[0] == "global"
        executors = [j.executor for j in runtime.jobs]
        MappedTaskBatches.__init__(self, client, manifest_dir, dataset, executors[-1],
                                   executors[0] if self._has_global else None, batch_size, device, rank, world_size,
                                   ledger=ledger)
        self._init_corun(runtime, step_boundary, step_done)

    def prepare_mapped(self, raw: MappedRaw) -> CorunBatch:
        raws = [raw.global_, raw.local] if self._has_global else [raw.local]
        return CorunBatch(dense=None, sparse=None, labels=raw.local.label.to(self.device),  # type: ignore[arg-type]  # filled by complete()
                          weights=raw.weights.to(self.device), real=raw.real, pending=self.runtime.launch_many(raws))

    def complete(self, batch: CorunBatch) -> None:
        outputs = batch.launched().results()
        dense, local_kjt = outputs[-1]
        batch.dense, batch.sparse = dense, self.features(local_kjt, outputs[0][1] if self._has_global else None)
