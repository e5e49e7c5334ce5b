"""How the dense gradients are averaged across ranks: one all_to_all exchange (train.dense_grad_exchange) or DDP's
allreduce.

With gloo on a small group, allreduce takes several latency-bound round trips (reduce-scatter, then all-gather): 1.7
ms for 32k floats on the 2-core machine, against 0.73 ms for one all_to_all in which every rank sends its whole
bucket to every other and each sums the copies in rank order (docs/performance.md, thirteenth session). That is
W x the bytes of an allreduce, so it is used for gloo groups of 2..MAX_EXCHANGE_RANKS ranks only."""
from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

MAX_EXCHANGE_RANKS = 4  # beyond this the W-fold traffic outweighs the round trips saved
MAX_EXCHANGE_ELEMENTS = 1 << 18  # larger buckets (data_parallel tables' gradients) are bandwidth-, not latency-bound
DenseSync = Literal["exchange", "allreduce", "none"]


def exchange_hook(group, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP comm hook (group: dist.ProcessGroup, bucket: dist.GradBucket -> Future[Tensor]): the bucket's mean over
    the group's ranks from one all_to_all of the whole bucket (buckets above MAX_EXCHANGE_ELEMENTS: an allreduce).
    Every rank adds the same copies in the same (rank) order, so every rank gets the same values."""
    world = dist.get_world_size(group)
    flat = bucket.buffer()
    if flat.numel() > MAX_EXCHANGE_ELEMENTS:  # DDP's own averaging: an allreduce of the mean's parts
        work = dist.all_reduce(flat.div_(world), group=group, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])
    received = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    work = dist.all_to_all_single(received, flat.repeat(world), group=group, async_op=True)
    assert work is not None  # async_op=True always returns a Work

    def average(_: torch.futures.Future) -> torch.Tensor:
        return received.view(world, -1).sum(0).div_(world)

    return work.get_future().then(average)


def ddp_modules(model: torch.nn.Module) -> list[DistributedDataParallel]:
    """The DistributedDataParallel wrappers in `model` (TorchRec's DMP wraps its dense part in one)."""
    return [m for m in model.modules() if isinstance(m, DistributedDataParallel)]


def use_dense_grad_exchange(model: torch.nn.Module) -> DenseSync:
    """Register exchange_hook on every DDP wrapper of `model` whose group is a gloo group of 2..MAX_EXCHANGE_RANKS
    ranks; returns what averages the dense gradients: exchange (every wrapper), allreduce (DDP's own, some or all),
    none (no DDP)."""
    wrappers = ddp_modules(model)
    if not wrappers:
        return "none"
    hooked = 0
    for ddp in wrappers:
        group = ddp.process_group  # the group DDP reduces over
        world, backend = dist.get_world_size(group), dist.get_backend(group)
        if backend == "gloo" and 2 <= world <= MAX_EXCHANGE_RANKS:
            ddp.register_comm_hook(group, exchange_hook)
            hooked += 1
        else:
            log.info("dense gradients: DDP's allreduce (%s, %d ranks: the exchange is for gloo groups of 2..%d)",
                     backend, world, MAX_EXCHANGE_RANKS)
    return "exchange" if hooked == len(wrappers) else "allreduce"
