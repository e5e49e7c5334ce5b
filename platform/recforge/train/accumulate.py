"""The step loop with gradient accumulation: k micro-batches per optimizer step on every rank.

Used after an out-of-memory failure (recforge.elastic.failover): each rank trains batch_size / k
rows at a time, k times per step, so the global batch, and with it the optimization, stays the same.
All k micro-batches of a step are fetched first; one all_reduce gives the step's global real-row
count, every micro-batch's loss is normalized by it (recforge.train.loss), gradients add up over the
k backward passes, then one optimizer step. A rank short of data pads with zero-weight batches, so
every rank runs k forwards per step (TorchRec's all-to-alls stay matched).

Exact for every parameter a regular optimizer steps (dense layers, data_parallel tables). Tables on
the fused kernel update inside each backward (their optimizer is applied in backward), so they take
k smaller steps instead of one: close to, not bit-identical with, the unaccumulated step.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from recforge.train.batches import Batch, TaskBatches
from recforge.train.loop import EpochStats, Heartbeat, LoopState, MetricsSink, WindowMetrics, _all_reduce
from recforge.train.loss import step_loss
from recforge.train.sharding import ShardedModel

log = logging.getLogger(__name__)


def train_epoch_accumulated(
    sharded: ShardedModel,
    source: TaskBatches,
    empty_batch: Batch,
    state: LoopState,
    *,
    epoch: int,
    world_size: int,
    log_every: int,
    accumulation: int,
    heartbeat: Heartbeat | None = None,
    sink: MetricsSink | None = None,
    rank: int = 0,
    resume: EpochStats | None = None,
    on_window: Callable[[LoopState, EpochStats], None] | None = None,
) -> EpochStats:
    if accumulation < 1:
        raise ValueError(f"accumulation must be >= 1, got {accumulation}")
    model, opt = sharded.model, sharded.optimizer
    model.train()
    stats = resume if resume is not None else EpochStats(epoch=epoch)
    t0 = win_t0 = time.perf_counter()
    win_loss, win_samples = 0.0, 0
    window = WindowMetrics()
    exhausted = False
    while True:
        micro: list[Batch | None] = []
        for _ in range(accumulation):
            b = None if exhausted else source.next()
            exhausted = exhausted or b is None
            micro.append(b)
        real = sum(b.real for b in micro if b is not None)
        g_has, g_real = _all_reduce([1.0 if real else 0.0, float(real)])
        if g_has == 0:
            break
        for b in micro:
            mb = b if b is not None else empty_batch
            logits = model(mb.dense, mb.sparse)
            loss, local_sum = step_loss(logits, mb.labels, mb.weights, g_real, world_size)
            window.add(logits, mb.labels, mb.weights)
            loss.backward()
            win_loss += float(local_sum)
        opt.step()
        opt.zero_grad()
        for b in micro:
            if b is not None:
                source.trained(b)
        win_samples += real
        state.step += 1
        stats.steps += 1
        if heartbeat is not None:
            heartbeat.maybe(state.step)
        if state.step % log_every == 0:
            g_loss, g_samples = _all_reduce([win_loss, float(win_samples)])
            quality = window.gather(world_size, rank)
            now = time.perf_counter()
            state.last_window_loss = g_loss / max(g_samples, 1.0)
            stats.loss_sum += g_loss
            stats.samples += int(g_samples)
            if rank == 0:
                sps = g_samples / max(now - win_t0, 1e-9)
                log.info("epoch %d step %d (x%d micro-batches): train loss %.5f, %.0f samples/s", epoch, state.step,
                         accumulation, state.last_window_loss, sps)
                if sink is not None:
                    sink({"train_loss": state.last_window_loss, "samples_per_s": sps, **quality}, state.step)
            win_t0, win_loss, win_samples = now, 0.0, 0
            if on_window is not None:
                on_window(state, stats)
    g_loss, g_samples = _all_reduce([win_loss, float(win_samples)])
    if g_samples:
        state.last_window_loss = g_loss / g_samples
    stats.loss_sum += g_loss
    stats.samples += int(g_samples)
    stats.wall_s += time.perf_counter() - t0
    stats.tasks_done = source.tasks_done
    state.epochs.append(stats)
    if rank == 0:
        log.info("epoch %d done: %d steps, %d samples, loss %.5f, %.1fs", epoch, stats.steps, stats.samples,
                 stats.loss, stats.wall_s)
    return stats
