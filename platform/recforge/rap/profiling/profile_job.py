"""Profile a pipeline job's training stages when no stored stage profile matches it (plan_resources, corun).

    profile = profile_job(cfg, plan, world_size, manifest_dir, threads=resources.threads_per_worker)

The job's own model, optimizers and first batches, on as many ranks as the job has workers (several as processes,
recforge.rap.profiling.profile_ranks), so collectives and contention are in the measured stages.
Design: docs/rap.md#the-stage-profiler; the CPU threshold and what 2 cores measure: docs/known_limits.md#rap.
"""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recforge.data.manifest import shard_rows_from_manifest
from recforge.data.shards import read_rows
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import make_executor
from recforge.preprocess.planning.plan import Plan
from recforge.rap.profiling.profiler import (
    BackgroundRunner,
    ProfileKey,
    ProfileMismatch,
    ProxyKernel,
    StageProfile,
    StageProfiler,
    log_profile,
)
from recforge.rap.profiling.stages import STAGES, StageTracker
from recforge.train.loop.batches import Batch, prepare
from recforge.train.loop.loss import step_loss
from recforge.train.model import build_dlrm
from recforge.train.sharding import shard_model

log = logging.getLogger(__name__)

CPU_THRESHOLD = 0.10  # not RAP's 2%: a shared CPU's stage medians move by more than 2% from run to run
CUDA_THRESHOLD = 0.02
BATCHES = 4  # distinct first batches, cycled over the profiling steps
STEPS_PER_POINT = 7
WARMUP = 3
MAX_UNITS = 128
PROXY_BYTES = 256 << 20  # the proxy's inputs: 4 * 8 float32 per row and unit


@contextlib.contextmanager
def single_rank_group(backend: str = "gloo"):
    """A one-rank group for the duration (shard_model needs one); an existing group must be one rank."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"profile_job: runs in one process, but a process group of "
                               f"{dist.get_world_size()} ranks is initialized here")
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def first_batches(manifest_dir: str | Path, dataset, executor, batch_size: int, count: int, device) -> list[Batch]:
    """Up to `count` padded, preprocessed batches from the first rows of the manifest's shards."""
    out: list[Batch] = []
    for shard, rows in enumerate(shard_rows_from_manifest(manifest_dir)):
        for start in range(0, rows, batch_size):
            if len(out) == count:
                return out
            raw = RawBatch.from_arrow(read_rows(manifest_dir, shard, start, min(rows, start + batch_size)), dataset)
            out.append(prepare(raw, batch_size, executor, device))
    if not out:
        raise ValueError(f"profile_job: the training manifest {manifest_dir} has no rows to profile on")
    return out


def proxy_units(rows: int, longest_stage_ms: float, unit_ms: float) -> int:
    """Proxy size cap: enough units to outlast the longest stage twice, within MAX_UNITS and PROXY_BYTES."""
    want = 2 ** math.ceil(math.log2(max(4.0, 2.0 * longest_stage_ms / max(unit_ms, 1e-6))))
    by_memory = max(1, PROXY_BYTES // (rows * 4 * 8 * 4))
    return int(max(1, min(want, MAX_UNITS, by_memory)))


def job_step(cfg, plan: Plan, dataset, manifest_dir: str | Path, world_size: int, device: torch.device):
    """The job's training step as a worker runs it (needs the process group): (tracker, step, steps served).
    Every rank builds the model from the worker's seed and trains on the manifest's first batches."""
    batch_size = cfg.train.batch_size
    executor = make_executor(cfg.preprocess_executor, plan, dataset)
    batches = first_batches(manifest_dir, dataset, executor, batch_size, BATCHES, device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # this process's RNG unmoved
        torch.manual_seed(cfg.seed)
        model = build_dlrm(cfg.model, plan.tables(), len(plan.dense_features()), device,
                           fused=cfg.train.fused_interaction)
    sharded = shard_model(model, cfg.train, world_size=world_size, device=device)
    net, opt = sharded.model, sharded.optimizer
    net.train()
    tracker = StageTracker(net)
    served = [0]

    def step() -> None:
        b = batches[served[0] % len(batches)]
        served[0] += 1
        loss, _ = step_loss(net(b.dense, b.sparse), b.labels, b.weights, float(batch_size * world_size), world_size)
        loss.backward()
        opt.step()
        opt.zero_grad()
        tracker.step_end()

    return tracker, step, served


# Rank 0 leads a multi-rank profile: before each step it tells the other ranks whether to step and where the proxy
# runs (every rank co-runs it, as every worker co-runs its preprocessing); outside the stages, so not measured.
_STOP, _STEP, _PROXY = 0, 1, 2


def _tell(world_size: int, kind: int, a: int = 0, b: int = 0) -> None:
    """Rank 0's message to the other ranks (nothing to tell in a single-rank profile)."""
    if world_size > 1:
        dist.broadcast(torch.tensor([kind, a, b], dtype=torch.int64), src=0)


def _target_code(target) -> tuple[int, int]:
    return (-1, 0) if target is None else (STAGES.index(target[0]), int(target[1]))


def lead_profile(cfg, key: ProfileKey, tracker, step, device: torch.device, world_size: int
                 ) -> tuple[StageProfile, int]:
    """Rank 0 (or the only rank): warm up, size the proxy, run the StageProfiler; (profile, max_units)."""
    batch_size = cfg.train.batch_size
    threshold = CUDA_THRESHOLD if device.type == "cuda" else CPU_THRESHOLD
    profiler: StageProfiler | None = None

    def led_step() -> None:
        _tell(world_size, _STEP, *_target_code(profiler.target if profiler is not None else None))
        step()

    runner = None
    try:
        for _ in range(WARMUP):
            led_step()
        longest = max(statistics.median(t.ms[s] for t in tracker.steps) for s in STAGES)
        unit_ms = ProxyKernel(batch_size, device, max_units=1).standalone_ms(1)
        max_units = proxy_units(batch_size, longest, unit_ms)
        _tell(world_size, _PROXY, max_units)
        runner = BackgroundRunner(cfg.corun.threads, device if device.type == "cuda" else None)
        profiler = StageProfiler(tracker, led_step, ProxyKernel(batch_size, device, max_units=max_units), runner,
                                 steps_per_point=STEPS_PER_POINT, warmup=1, paired=True)
        profile = profiler.run(key, threshold=threshold, max_units=max_units)
        # not after a failure: the others may be inside a step's collectives; this rank exits and the launcher
        # (recforge.rap.profiling.profile_ranks) ends them
        _tell(world_size, _STOP)
    finally:
        if runner is not None:
            runner.close()
    return profile, max_units


def follow_profile(cfg, tracker, step, device: torch.device) -> None:
    """Ranks > 0: step when rank 0 steps, with the proxy where rank 0 puts it, until it stops."""
    batch_size = cfg.train.batch_size
    profiler, runner = None, None
    try:
        while True:
            msg = torch.zeros(3, dtype=torch.int64)
            dist.broadcast(msg, src=0)
            kind, a, b = msg.tolist()
            if kind == _STOP:
                return
            if kind == _PROXY:
                runner = BackgroundRunner(cfg.corun.threads, device if device.type == "cuda" else None)
                profiler = StageProfiler(tracker, step, ProxyKernel(batch_size, device, max_units=a), runner)
                continue
            if profiler is not None:
                profiler.set_target(None if a < 0 else (STAGES[a], b))
            step()
    finally:
        if runner is not None:
            runner.close()


def profile_job(cfg, plan: Plan, world_size: int, manifest_dir: str | Path, threads: int = 1,
                device: str | torch.device = "cpu", dataset=None) -> StageProfile:
    """The job's StageProfile (not stored: store_and_log does). `cfg`: the PipelineConfig; `dataset`: the
    manifest's schema (default cfg.dataset()). World size 1: in this process; more: that many processes
    (recforge.rap.profiling.profile_ranks), so the collectives and the workers' contention are in the stages."""
    device = torch.device(device)
    key = ProfileKey.of(cfg.model, plan.tables(), world_size, cfg.train.batch_size, device)
    dataset = dataset or cfg.dataset()
    t0 = time.perf_counter()
    if not sum(shard_rows_from_manifest(manifest_dir)):  # fail here, not in the ranks
        raise ValueError(f"profile_job: the training manifest {manifest_dir} has no rows to profile on")
    if world_size > 1:
        from recforge.rap.profiling.profile_ranks import profile_in_processes  # lazy: profile_ranks imports this module

        profile = profile_in_processes(cfg, plan, dataset, world_size, manifest_dir, threads, device)
    else:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)  # the worker's trainer budget
        try:
            # sharding and training draw from the global RNG: leave this process's as it was
            with single_rank_group("nccl" if device.type == "cuda" else "gloo"), torch.random.fork_rng(
                    devices=[device] if device.type == "cuda" else []):
                tracker, step, served = job_step(cfg, plan, dataset, manifest_dir, 1, device)
                t_steps = time.perf_counter()
                try:
                    profile, max_units = lead_profile(cfg, key, tracker, step, device, 1)
                finally:
                    tracker.detach()
        finally:
            torch.set_num_threads(before)
        describe(profile, key, threads, max_units, served[0], t_steps)
    profile.meta["seconds"] = round(time.perf_counter() - t0, 3)  # all of it, the executor's first call included
    log.info("profiled %s in %.1f s (%.1f s of %d steps on %d ranks, threshold %.0f%%): stage ms %s, capacity ms %s",
             key.slug(), profile.meta["seconds"], profile.meta["step_seconds"], profile.meta["steps"], world_size,
             profile.threshold * 100, {s: round(v, 3) for s, v in profile.stage_ms.items()},
             {s: round(v, 3) for s, v in profile.capacity_ms.items()})
    return profile


def describe(profile: StageProfile, key: ProfileKey, threads: int, max_units: int, steps: int, t_steps: float) -> None:
    """What the profile measured (on key.world_size ranks), into its meta."""
    ranks = key.world_size
    profile.meta |= {
        "source": f"recforge.rap.profiling.profile_job: profiling run of the job's model on its first batches, {ranks} "
                  f"rank(s) (rank 0's stages; every rank co-runs the proxy)",
        "single_process": ranks == 1, "profiled_world_size": ranks, "batches": BATCHES, "steps": steps,
        "trainer_threads": threads, "max_units": max_units,
        "capped_stages": [s for s in STAGES if profile.capacity_units[s] >= max_units],
        "proxy": "fused_ngram(n=4) over [batch, 8] float32, 4 features per unit (RAP's proxy)",
        "step_seconds": round(time.perf_counter() - t_steps, 3),  # the profiling steps and the search
    }


def profile_figure(profile: StageProfile):
    """Bars per stage: the measured duration and the spare capacity found (proxy standalone ms)."""
    import matplotlib  # lazy: matplotlib only when a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after choosing the Agg backend

    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = range(len(STAGES))
    ax.bar([i - 0.2 for i in x], [profile.stage_ms[s] for s in STAGES], width=0.4, label="stage duration")
    ax.bar([i + 0.2 for i in x], [profile.capacity_ms[s] for s in STAGES], width=0.4, label="spare capacity")
    ax.set_xticks(list(x), STAGES)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"stage profile {profile.key.slug()} (threshold {profile.threshold:.0%})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def store_and_log(profile: StageProfile, root: str | Path, store, run_id: str) -> Path:
    """Save the profile under `root` and log it (JSON, metrics, the bar chart) into the MLflow run."""
    import matplotlib.pyplot as plt  # lazy: matplotlib only when a chart is drawn

    path = profile.save(root)
    log_profile(profile, store, run_id)
    fig = profile_figure(profile)
    store.log_figure(run_id, fig, "rap/stage_profile.png")
    plt.close(fig)
    store.log_params(run_id, {"rap_profile": profile.key.slug(), "rap_profile_threshold": profile.threshold})
    return path


def ensure_profile(cfg, plan: Plan, world_size: int, manifest_dir: str | Path, profile_dir: str | Path, store,
                   run_id: str, threads: int = 1, dataset=None) -> tuple[StageProfile, str]:
    """(the stored profile matching the job, 'stored'), else a fresh one, stored and logged, and 'profiled'."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    key = ProfileKey.of(cfg.model, plan.tables(), world_size, cfg.train.batch_size, device)
    try:
        profile = StageProfile.load(profile_dir, key)
        log_profile(profile, store, run_id)
        return profile, "stored"
    except ProfileMismatch as e:
        log.info("profiling the job's training stages: %s", e)
    profile = profile_job(cfg, plan, world_size, manifest_dir, threads=threads, device=device, dataset=dataset)
    store_and_log(profile, profile_dir, store, run_id)
    return profile, "profiled"


def summary(profile: StageProfile, origin: str) -> dict[str, Any]:
    return {"key": profile.key.slug(), "origin": origin, "threshold": profile.threshold,
            "stage_ms": profile.stage_ms, "capacity_ms": profile.capacity_ms,
            "seconds": profile.meta.get("seconds")}
