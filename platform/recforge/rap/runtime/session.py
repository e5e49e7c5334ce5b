"""One worker's RAP co-run: the runtime, the stage tracker on the model, and what to log about them.

    session = CorunSession(plan, dataset, schedule, model, device, threads=1, sharding=sharded.plan_summary())
    source = session.batches(client, manifest_dir, dataset, batch_size, device, ledger)   # per epoch
    ... train_epoch(..., source, ...) ...
    session.close(); session.summary()    # predicted vs measured iteration time, kernel / wait medians

Everything that can be wrong with the setup (a schedule that misses a fused kernel or names an unknown one, plan
features without a table in the sharding plan, too many co-run threads) raises here, before the first step.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from recforge.config import DatasetConfig
from recforge.preprocess.executor import make_executor
from recforge.preprocess.planning.plan import Plan
from recforge.rap.mapping.mapped_batches import MappedCorunBatches
from recforge.rap.mapping.mapped_input import MappedInput
from recforge.rap.planning.schedule import CorunSchedule
from recforge.rap.profiling.stages import StageTracker
from recforge.rap.runtime.corun_batches import CorunTaskBatches
from recforge.rap.runtime.corun_runtime import CorunConfigError, CorunRuntime, check_plan_in_sharding


def corun_executor(plan: Plan, dataset: DatasetConfig):
    """The fused executor the runtime drives (its own instance: its kernel caches are used by one thread)."""
    return make_executor("fused", plan, dataset)


def check_jobs_match_sharding(runtime: CorunRuntime, mapped: MappedInput) -> None:
    """CorunConfigError unless the jobs preprocess exactly what the sharded model's lookups on this rank take: the
    global job the tables it holds, the local job the data_parallel tables' features."""
    have = {j.name: set(j.executor.plan.sparse_features()) for j in runtime.jobs}
    want = {"global": set(mapped.global_features), "local": set(mapped.local_features)}
    for job in ("global", "local"):
        if have.get(job, set()) != want[job]:
            raise CorunConfigError(
                f"mapped co-run on rank {mapped.rank}: the {job} job preprocesses {sorted(have.get(job, set()))}, "
                f"the sharded model's lookups take {sorted(want[job])} "
                "(placements and schedules from different plans?)")


class CorunSession:
    def __init__(self, plan: Plan, dataset: DatasetConfig, schedule: CorunSchedule | None, model: torch.nn.Module,
                 device: torch.device | str = "cpu", threads: int = 1, sharding: dict[str, Any] | None = None,
                 executor=None, *, jobs=None, mapped: MappedInput | None = None) -> None:
        """`jobs` + `mapped` (RAP's mapping): the runtime's [(executor, schedule)] from
        recforge.rap.planning.scheduler.mapped_rank_schedules and the model's MappedInput; the batches are then
        MappedCorunBatches (global batch of the tables this rank holds, no input all-to-all)."""
        if sharding is not None:
            check_plan_in_sharding(plan.sparse_features(), sharding)
        if (jobs is None) != (mapped is None):
            raise CorunConfigError("CorunSession: jobs and mapped go together (RAP's mapping), or neither")
        if jobs is not None:
            self.runtime = CorunRuntime(jobs=jobs, device=device, threads=threads)
        else:
            self.runtime = CorunRuntime(executor or corun_executor(plan, dataset), schedule, device, threads=threads)
        self.mapped = mapped
        self.input_all_to_all_used: bool | None = None  # mapped: set at close (before anything else runs the model)
        if mapped is not None:
            check_jobs_match_sharding(self.runtime, mapped)
        self.tracker = StageTracker(model, on_enter=self.runtime.on_enter)
        self._last_boundary: float | None = None
        self._stepped = False
        self.iteration_ms: list[float] = []  # wall time between successive batch requests with a step between
        self._sources: list[CorunTaskBatches | MappedCorunBatches] = []

    def batches(self, client, manifest_dir: str | Path, dataset: DatasetConfig, batch_size: int,
                device: torch.device, ledger=None, source_cls: type[CorunTaskBatches] = CorunTaskBatches,
                ) -> CorunTaskBatches | MappedCorunBatches:
        source: CorunTaskBatches | MappedCorunBatches
        if self.mapped is not None:
            source = MappedCorunBatches(client, manifest_dir, dataset, self.runtime, batch_size, device,
                                        self.mapped.rank, self.mapped.world_size, ledger=ledger,
                                        step_boundary=self.step_boundary, step_done=self.step_done)
        else:
            source = source_cls(client, manifest_dir, dataset, self.runtime, batch_size, device, ledger=ledger,
                                step_boundary=self.step_boundary, step_done=self.step_done)
        self._sources.append(source)
        return source

    def step_done(self) -> None:
        """Right after the optimizer step (a batch reported trained): the step's allreduce stage ends here, so the
        measured stages are the profiled ones, without the trainer's bookkeeping and the next batch's handout."""
        if self.tracker.stage == "allreduce":
            self.tracker.step_end()
            self._stepped = True

    def step_boundary(self) -> None:
        """Before each batch request: the previous step (if any) is over, optimizer step included."""
        now = time.perf_counter()
        self.step_done()
        if self._stepped and self._last_boundary is not None:
            self.iteration_ms.append((now - self._last_boundary) * 1e3)
        self._stepped = False
        self._last_boundary = now

    def close(self) -> None:
        if self.mapped is not None:  # torchrec builds the input all-to-all on its first use: was it ever used?
            self.input_all_to_all_used = not self.mapped.sebc._has_uninitialized_input_dist
        self.step_boundary()
        for s in self._sources:
            s.close()
        self.tracker.detach()
        self.runtime.close()

    def summary(self) -> dict[str, Any]:
        """Predicted (the schedule's meta, when its planner gave one) against measured medians, in ms."""
        schedules = [j.schedule for j in self.runtime.jobs]
        predicted = [m for sc in schedules if (m := sc.meta.get("predicted_iteration_ms")) is not None]
        stage_ms = {}
        if self.tracker.steps:
            stage_ms = {s: round(statistics.median(t.ms[s] for t in self.tracker.steps), 4)
                        for s in self.tracker.steps[0].ms}
        out = {
            "plan": schedules[-1].plan_name if self.mapped is None else schedules[-1].plan_name.rsplit(".", 1)[0],
            "measured_iteration_ms": round(statistics.median(self.iteration_ms), 4) if self.iteration_ms else None,
            "measured_stage_ms": stage_ms,
            "predicted_iteration_ms": max(predicted) if predicted else None,
            "steps": len(self.tracker.steps),
            **self.runtime.summary(),
            "schedule": json.loads(schedules[-1].to_json()),
        }
        if self.mapped is not None:  # one schedule per job, in job order (global first); `schedule` is the local one
            out["mapped"] = {"input_all_to_all_used": self.input_all_to_all_used,
                             "global_features": self.mapped.global_features,
                             "local_features": self.mapped.local_features,
                             "schedules": {j.name: json.loads(j.schedule.to_json()) for j in self.runtime.jobs}}
        return out
