"""The step loop with gradient accumulation: k micro-batches per optimizer step on every rank.

Used after an out-of-memory failure (recforge.elastic.master.failover): each rank trains batch_size / k
rows at a time, k times per step, so the global batch, and with it the optimization, stays the same.
All k micro-batches of a step are fetched first; one all_reduce gives the step's global real-row
count, every micro-batch's loss is normalized by it (recforge.train.loop.loss), gradients add up over the
k backward passes, then one optimizer step. A rank short of data pads with zero-weight batches, so
every rank runs k forwards per step (TorchRec's all-to-alls stay matched).

Exact for every parameter a regular optimizer steps (dense layers, data_parallel tables). Tables on
the fused kernel update inside each backward (their optimizer is applied in backward), so they take
k smaller steps instead of one: close to, not bit-identical with, the unaccumulated step.
"""
from __future__ import annotations

from typing import Any

from recforge.train.loop.batches import Batch, TaskBatches
from recforge.train.loop.prefetch import PrefetchBatches
from recforge.train.loop.step_loop import EpochStats, LoopState, train_epoch
from recforge.train.sharding import ShardedModel


def train_epoch_accumulated(sharded: ShardedModel, source: TaskBatches | PrefetchBatches, empty_batch: Batch,
                            state: LoopState, *, accumulation: int, **loop_kwargs: Any) -> EpochStats:
    """`recforge.train.loop.step_loop.train_epoch` with `accumulation` micro-batches per optimizer step."""
    return train_epoch(sharded, source, empty_batch, state, accumulation=accumulation, **loop_kwargs)
