"""recforge.train.dense_sync: the exchange hook averages a DDP bucket like allreduce does (2 gloo ranks, the same
values on both), and is used only where it applies."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from recforge.elastic.backends.local import free_port


def _ranks(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import recforge.train.dense_sync as dense_sync
    from recforge.train.dense_sync import use_dense_grad_exchange

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        grads = {}
        for variant in ("allreduce", "exchange", "large"):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
            ddp = DistributedDataParallel(net)
            # "large": every bucket above the exchange's size limit, so the hook takes its allreduce path
            dense_sync.MAX_EXCHANGE_ELEMENTS = 1 if variant == "large" else 1 << 18
            sync = use_dense_grad_exchange(ddp) if variant != "allreduce" else "allreduce"
            sync = "large" if variant == "large" else sync
            x = torch.randn(6, 7, generator=torch.Generator().manual_seed(rank))  # each rank its own batch
            ddp(x).square().sum().backward()
            grads[sync] = [p.grad.clone() for p in net.parameters()]
        torch.save(grads, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_exchange_averages_like_allreduce_on_every_rank(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ranks, args=(2, free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert set(r0) == {"allreduce", "exchange", "large"}  # 2 gloo ranks: the hook was registered
    for a, b in zip(r0["exchange"], r1["exchange"], strict=True):
        assert torch.equal(a, b)  # the same copies added in the same order on both ranks
    for a, b, c in zip(r0["exchange"], r0["allreduce"], r0["large"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the mean DDP's allreduce gives
        torch.testing.assert_close(c, b, rtol=1e-6, atol=1e-7)  # the hook's allreduce path: the same mean
    assert any(g.abs().sum() > 0 for g in r0["exchange"])


def test_without_ddp_or_outside_its_group_sizes_nothing_is_registered():
    from recforge.train.dense_sync import use_dense_grad_exchange

    assert use_dense_grad_exchange(torch.nn.Linear(2, 2)) == "none"  # no DDP wrapper: nothing to average
