"""StageTracker on the real DLRM: bare, and inside a one-rank DMP with fused TBE + optimizer in backward."""
from __future__ import annotations

import os
import socket

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import ModelConfig, TrainConfig
from recforge.rap.profiling.stages import STAGES, StageOrderError, StageTracker
from recforge.train.model import build_dlrm

TABLES = [("C1", 50), ("C2", 30), ("C3", 20)]
B = 16


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(B, 4, generator=g)
    ids = torch.stack([torch.randint(0, n, (B,), generator=g) for _, n in TABLES], 1)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[t for t, _ in TABLES], values=ids.t().reshape(-1), lengths=torch.ones(B * len(TABLES), dtype=torch.int64))
    labels = torch.randint(0, 2, (B,), generator=g).float()
    return dense, kjt, labels


def _model():
    torch.manual_seed(0)
    return build_dlrm(ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[16, 1]), TABLES, 4)


def _step(model, opt, tracker, seed=0, begin=False):
    dense, kjt, labels = _batch(seed)
    if begin:
        tracker.step_begin()
    logits = model(dense, kjt)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.reshape(-1), labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return tracker.step_end()


class _Log:
    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def enter(self, s):
        self.events.append(("enter", s))

    def exit(self, s):
        self.events.append(("exit", s))


EXPECTED = [(k, s) for s in STAGES for k in ("enter", "exit")]


def test_callbacks_fire_in_stage_order_on_a_bare_dlrm():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = _Log()
    tracker = StageTracker(model, on_enter=log.enter, on_exit=log.exit)
    for seed in range(2):
        timing = _step(model, opt, tracker, seed)
        assert set(timing.ms) == set(STAGES) and all(v >= 0 for v in timing.ms.values())
        assert timing.cuda_ms is None
    assert log.events == EXPECTED * 2
    assert len(tracker.steps) == 2 and tracker.stage is None


def test_step_begin_opens_the_step_once():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = _Log()
    tracker = StageTracker(model, on_enter=log.enter, on_exit=log.exit)
    _step(model, opt, tracker, begin=True)
    assert log.events == EXPECTED
    with pytest.raises(StageOrderError, match="step_begin"):
        tracker.step_begin()
        tracker.step_begin()


def test_eval_and_no_grad_forwards_are_ignored():
    model = _model()
    log = _Log()
    tracker = StageTracker(model, on_enter=log.enter, on_exit=log.exit)
    dense, kjt, _ = _batch()
    with torch.no_grad():
        model(dense, kjt)
    model.eval()
    model(dense, kjt)
    assert log.events == [] and tracker.stage is None


def test_step_end_without_backward_names_the_stage():
    model = _model()
    tracker = StageTracker(model)
    dense, kjt, _ = _batch()
    model(dense, kjt)
    with pytest.raises(StageOrderError, match="mlp_fwd"):
        tracker.step_end()


def test_detach_removes_every_hook_and_training_is_unchanged():
    ref, tracked = _model(), _model()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, tracked)]
    log = _Log()
    tracker = StageTracker(tracked, on_enter=log.enter, on_exit=log.exit)
    for seed in range(2):
        dense, kjt, labels = _batch(seed)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(ref(dense, kjt).reshape(-1), labels)
        loss.backward()
        opts[0].step()
        opts[0].zero_grad()
        _step(tracked, opts[1], tracker, seed)
    for a, b in zip(ref.state_dict().values(), tracked.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    tracker.detach()
    before = len(log.events)
    dense, kjt, labels = _batch(5)
    tracked(dense, kjt).sum().backward()
    assert len(log.events) == before
    assert not tracked._forward_hooks and not tracked._forward_pre_hooks
    assert not tracked.sparse_arch._forward_hooks


def test_not_a_dlrm_is_refused():
    with pytest.raises(TypeError, match="sparse_arch"):
        StageTracker(torch.nn.Linear(2, 2))


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["table_wise", "data_parallel"])
def test_dmp_with_fused_optimizer_in_backward(one_rank_group, sharding):
    from recforge.train.sharding import shard_model

    sm = shard_model(_model(), TrainConfig(sharding=sharding), world_size=1, device=torch.device("cpu"))
    log = _Log()
    tracker = StageTracker(sm.model, on_enter=log.enter, on_exit=log.exit)
    for seed in range(2):
        _step(sm.model, sm.optimizer, tracker, seed)
    assert log.events == EXPECTED * 2
    tracker.detach()


def test_gradient_accumulation_makes_each_micro_batch_a_step():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = _Log()
    tracker = StageTracker(model, on_enter=log.enter, on_exit=log.exit)
    for seed in range(3):  # three micro-batches, one optimizer step
        dense, kjt, labels = _batch(seed)
        torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).reshape(-1), labels).backward()
    opt.step()
    tracker.step_end()
    assert log.events == EXPECTED * 3 and len(tracker.steps) == 3
