"""The synchronous step loop: every rank steps in lockstep, padded batches, exact loss normalization.

Per step one all_reduce of [has_data, real_rows] decides whether the epoch goes on (some rank still
has data) and gives the global weight for the loss (recforge.train.loop.loss). A rank without data trains
a fully zero-weight batch, so TorchRec's all-to-alls always see equal batch sizes. A source with `next_step`
(recforge.train.loop.prefetch.PrefetchBatches) hands out whole steps with those counts already all-reduced on its
thread, so the loop does not block on them. Over such a source (accumulation 1) the loop can also run TorchRec's
TrainPipelineSparseDist (recforge.train.loop.pipelined: each step's sparse input dist overlapped with the previous
step; train.sparse_dist_pipeline, off by default).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel

from recforge.train.loop.batches import Batch, TaskBatches
from recforge.train.loop.loss import step_loss
from recforge.train.loop.pipelined import StepPipeline, step_iterator
from recforge.train.loop.prefetch import PrefetchBatches
from recforge.train.loop.window_metrics import MetricsSink, WindowMetrics, WindowReporter
from recforge.train.sharding import ShardedModel

log = logging.getLogger(__name__)

PHASES = ("data", "input_dist", "forward", "backward", "optimizer", "coordination")


class PhaseTimes:
    """Seconds a rank's step loop spent per phase (wall clock, CPU: every op is synchronous): data (waiting for
    the step's batches and global counts), input_dist (pipelined loop only: starting / finishing the next step's
    sparse input dist, zero_grad), forward, backward, optimizer, coordination (done reports, heartbeats, window
    metrics, the window hook). TorchRec's all-to-alls run inside forward / backward (the input one in input_dist when
    pipelined), DDP's all_reduce in backward. Also the loop thread's CPU seconds per phase (`time.thread_time`): wall
    minus CPU is time spent waiting (for the other ranks in a collective, or for a core)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.cpu_seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._t = time.perf_counter()
        self._c = time.thread_time()

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark to `phase`."""
        now, cpu = time.perf_counter(), time.thread_time()
        self.seconds[phase] += now - self._t
        self.cpu_seconds[phase] += cpu - self._c
        self._t, self._c = now, cpu

    def restart(self) -> None:
        self._t, self._c = time.perf_counter(), time.thread_time()

    def to_dict(self) -> dict[str, float]:
        return {"steps": float(self.steps), **{f"{k}_s": v for k, v in self.seconds.items()},
                **{f"{k}_cpu_s": v for k, v in self.cpu_seconds.items()}}


@dataclass
class EpochStats:
    epoch: int
    steps: int = 0
    samples: int = 0  # real rows trained, all ranks
    loss_sum: float = 0.0  # weighted BCE summed over those rows
    wall_s: float = 0.0
    tasks_done: int = 0  # this rank's

    @property
    def loss(self) -> float:
        return self.loss_sum / self.samples if self.samples else float("nan")


@dataclass
class LoopState:
    step: int = 0
    epochs: list[EpochStats] = field(default_factory=list)
    last_window_loss: float = float("nan")


class Heartbeat:
    def __init__(self, client, interval_s: float) -> None:
        self.client, self.interval_s, self._last = client, interval_s, time.monotonic()

    def maybe(self, step: int) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self.client.heartbeat(step)
            self._last = now


def _all_reduce(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def pipeline_applies(sharded: ShardedModel, source: object, accumulation: int) -> bool:
    """Whether train_epoch can run the pipelined loop: a PrefetchBatches source (steps and their global counts built
    ahead), no gradient accumulation, a DistributedModelParallel model."""
    return (isinstance(source, PrefetchBatches) and accumulation == 1
            and isinstance(sharded.model, DistributedModelParallel))


def train_epoch(
    sharded: ShardedModel,
    source: TaskBatches | PrefetchBatches,
    empty_batch: Batch,
    state: LoopState,
    *,
    epoch: int,
    world_size: int,
    log_every: int,
    heartbeat: Heartbeat | None = None,
    sink: MetricsSink | None = None,
    rank: int = 0,
    resume: EpochStats | None = None,
    on_window: Callable[[LoopState, EpochStats], None] | None = None,
    accumulation: int = 1,
    phases: PhaseTimes | None = None,
    pipelined: bool = False,
) -> EpochStats:
    """`resume`: the counters of this epoch restored from a checkpoint. `on_window(state, stats)` runs
    on every rank at each logging-window boundary, when `stats` is exact (checkpoints happen there).
    `accumulation`: micro-batches per optimizer step (recforge.train.loop.accumulate explains the > 1 case).
    `phases`: where to add the loop's time per phase (PhaseTimes), for profiling.
    `pipelined`: overlap each step's sparse input dist with the previous step (recforge.train.loop.pipelined:
    TorchRec's TrainPipelineSparseDist); only over a PrefetchBatches source with accumulation 1 and a DMP model
    (`pipeline_applies`)."""
    if accumulation < 1:
        raise ValueError(f"accumulation must be >= 1, got {accumulation}")
    model, opt = sharded.model, sharded.optimizer
    if pipelined and not pipeline_applies(sharded, source, accumulation):
        raise ValueError("pipelined=True needs a PrefetchBatches source, accumulation 1 and a DistributedModelParallel "
                         f"model (got {type(source).__name__}, accumulation {accumulation}, {type(model).__name__})")
    model.train()
    stats = resume if resume is not None else EpochStats(epoch=epoch)
    t0 = time.perf_counter()
    win: dict[str, float] = {"t0": t0, "loss": 0.0, "samples": 0.0}
    window = WindowMetrics()
    tag = f" (x{accumulation} micro-batches)" if accumulation > 1 else ""
    pt = phases if phases is not None else PhaseTimes()

    def after_step(trained: list[Batch | None], real: int) -> None:
        """Everything after a step's optimizer update: done reports, counters, heartbeat, the window."""
        for b in trained:
            if b is not None:
                source.trained(b)
        state.step += 1
        stats.steps += 1
        pt.steps += 1
        win["samples"] += real
        if heartbeat is not None:
            heartbeat.maybe(state.step)
        if state.step % log_every == 0:
            g_loss, g_samples = _all_reduce([win["loss"], float(win["samples"])])
            rows = window.gather_rows(world_size, rank)
            now = time.perf_counter()
            state.last_window_loss = g_loss / max(g_samples, 1.0)
            stats.loss_sum += g_loss
            stats.samples += int(g_samples)
            if rank == 0:
                sps = g_samples / max(now - win["t0"], 1e-9)
                log.info("epoch %d step %d%s: train loss %.5f, %.0f samples/s", epoch, state.step, tag,
                         state.last_window_loss, sps)
                if reporter is not None:
                    reporter.report({"train_loss": state.last_window_loss, "samples_per_s": sps}, state.step, rows)
            win.update(t0=now, loss=0.0, samples=0)
            if on_window is not None:
                on_window(state, stats)
        pt.mark("coordination")

    # rank 0's window metrics (their AUC included) go to the sink from a thread: the other ranks do not wait for them
    reporter = WindowReporter(sink) if rank == 0 and sink is not None else None
    try:
        pt.restart()
        if pipelined:
            assert isinstance(source, PrefetchBatches) and isinstance(model, DistributedModelParallel)
            source.defer_progress()  # steps in flight are not trained: a checkpoint must not count their rows
            if rank == 0:
                log.info("epoch %d: pipelined step loop (TorchRec TrainPipelineSparseDist over prefetched steps)",
                         epoch)
            pipe = StepPipeline(model, opt, world_size=world_size, mark=pt.mark, quiet=source.paused)
            steps = step_iterator(source.next_step, empty_batch, pt.mark)
            try:
                while True:
                    try:
                        logits, local_sum, done = pipe.progress(steps)
                    except StopIteration:
                        break
                    window.add(logits, done.labels, done.weights)
                    win["loss"] += float(local_sum)
                    after_step([done.batch], done.real)
            finally:
                pipe.detach()  # the sharded EBC's own forward back (evaluation, the probe, the next epoch)
                model.train()
        else:
            next_step = source.next_step if isinstance(source, PrefetchBatches) else None  # steps built ahead
            while True:
                if next_step is not None:
                    step = next_step()
                    if step is None:
                        break
                    micro, g_real, real = step.micro, step.g_real, step.real
                    if len(micro) != accumulation:
                        raise ValueError(f"the source's steps have {len(micro)} micro-batches, the loop {accumulation}")
                else:
                    micro = []
                    for _ in range(accumulation):  # a step's micro-batches; none asked for after the source ran dry
                        micro.append(source.next() if not micro or micro[-1] is not None else None)
                    real = sum(b.real for b in micro if b is not None)
                    g_has, g_real = _all_reduce([1.0 if micro[0] is not None else 0.0, float(real)])
                    if g_has == 0:
                        break
                pt.mark("data")
                for b in micro:
                    mb = b if b is not None else empty_batch
                    logits = model(mb.dense, mb.sparse)
                    loss, local_sum = step_loss(logits, mb.labels, mb.weights, g_real, world_size)
                    window.add(logits, mb.labels, mb.weights)
                    pt.mark("forward")
                    loss.backward()
                    win["loss"] += float(local_sum)
                    pt.mark("backward")
                opt.step()
                opt.zero_grad()
                pt.mark("optimizer")
                after_step(micro, real)
        # the epoch's done reports sent, the thread stopped: tasks_done is exact
        if isinstance(source, PrefetchBatches):
            source.close()
        g_loss, g_samples = _all_reduce([win["loss"], float(win["samples"])])
        if g_samples:
            state.last_window_loss = g_loss / g_samples
            # the trailing part-window is logged too, so the curve ends at the last step (and a job shorter than
            # log_every steps still has one point); every rank takes this branch (g_samples is all-reduced)
            rows = window.gather_rows(world_size, rank)
            if reporter is not None:
                sps = g_samples / max(time.perf_counter() - win["t0"], 1e-9)
                reporter.report({"train_loss": state.last_window_loss, "samples_per_s": sps}, state.step, rows)
        stats.loss_sum += g_loss
        stats.samples += int(g_samples)
        stats.wall_s += time.perf_counter() - t0
        stats.tasks_done = source.tasks_done
        state.epochs.append(stats)
        if rank == 0:
            log.info("epoch %d done: %d steps, %d samples, loss %.5f, %.1fs",
                     epoch, stats.steps, stats.samples, stats.loss, stats.wall_s)
        return stats
    finally:
        if reporter is not None:
            reporter.close()
