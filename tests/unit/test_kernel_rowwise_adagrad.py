"""recforge_kernels.rowwise_adagrad: the C++ lookup and row-wise Adagrad backward against FBGEMM's own module (the
same state after several steps with repeated rows and empty bags) and against a plain torch reference; learning-rate
changes, the fallbacks to FBGEMM's forward, what it refuses and why."""
from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from recforge_kernels import rowwise_adagrad as ra

pytestmark = pytest.mark.skipif(ra.LIBRARY.ops() is None, reason="the C++ kernels cannot be built here")

SPECS = [(50, 16), (7, 8), (3000, 4)]  # (rows, dim) per table; table 1 is tiny: many repeated rows


def _tbe(specs=SPECS, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr=0.05, **kw):
    torch.manual_seed(0)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for r, d in specs], optimizer=optimizer,
        learning_rate=lr, eps=1e-8, **kw)


def _batch(step, specs=SPECS, batch=32, max_len=4, hot=None):
    """indices / offsets with bags of 0..max_len-1 ids (empty bags included); `hot` ids per table concentrate them."""
    g = torch.Generator().manual_seed(step)
    lens = torch.randint(0, max_len, (len(specs) * batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    ids = [torch.randint(0, min(r, hot or r), (int(lens[t * batch:(t + 1) * batch].sum()),), generator=g)
           for t, (r, _) in enumerate(specs)]
    grad = torch.randn(batch, sum(d for _, d in specs), generator=g)
    return torch.cat(ids), offsets, grad


def _reference_step(weights, momentum, specs, indices, offsets, grad, lr, eps=1e-8):
    """Row-wise Adagrad by hand: each distinct row's summed gradient g; m += mean(g^2); w -= lr g / (sqrt(m) + eps)."""
    batch = (offsets.numel() - 1) // len(specs)
    col = 0
    for t, (rows, d) in enumerate(specs):
        g_rows = torch.zeros(rows, d, dtype=torch.float64)
        for b in range(batch):
            lo, hi = int(offsets[t * batch + b]), int(offsets[t * batch + b + 1])
            for p in range(lo, hi):
                g_rows[indices[p]] += grad[b, col:col + d].double()
        touched = g_rows.abs().sum(1) > 0
        momentum[t][touched] += (g_rows[touched] ** 2).mean(1)
        step = lr / (momentum[t][touched].sqrt() + eps)
        weights[t][touched] -= step[:, None] * g_rows[touched]
        col += d


def test_steps_equal_fbgemm_and_a_reference_with_repeated_rows_and_empty_bags():
    stock, fast = _tbe(), _tbe()
    assert ra.install(fast) and ra.install(fast)  # idempotent
    weights = [w.detach().double().clone() for w in stock.split_embedding_weights()]
    momentum = [torch.zeros(r, dtype=torch.float64) for r, _ in SPECS]
    for step in range(6):
        indices, offsets, grad = _batch(step, hot=5 if step % 2 else None)
        out_stock, out_fast = stock(indices, offsets), fast(indices, offsets)
        torch.testing.assert_close(out_fast, out_stock, rtol=1e-6, atol=1e-6)  # the same rows, summed in bag order
        assert out_fast.requires_grad
        out_stock.backward(grad)
        out_fast.backward(grad)
        _reference_step(weights, momentum, SPECS, indices, offsets, grad, lr=0.05)
    tables = zip(fast.split_embedding_weights(), stock.split_embedding_weights(), weights, strict=True)
    for w_fast, w_stock, w_ref in tables:
        torch.testing.assert_close(w_fast, w_stock, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w_fast.double(), w_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast.momentum1_host, stock.momentum1_host, rtol=1e-5, atol=1e-7)
    assert not torch.equal(fast.weights_host, _tbe().weights_host)  # the steps moved the weights


def test_a_learning_rate_change_is_applied():
    stock, fast = _tbe(), _tbe()
    ra.install(fast)
    for m in (stock, fast):
        m.set_learning_rate(0.3)
    indices, offsets, grad = _batch(0)
    stock(indices, offsets).backward(grad)
    fast(indices, offsets).backward(grad)
    torch.testing.assert_close(fast.weights_host, stock.weights_host, rtol=1e-5, atol=1e-6)


def test_without_autograd_or_with_per_sample_weights_fbgemm_runs():
    stock, fast = _tbe(), _tbe()
    ra.install(fast)
    indices, offsets, grad = _batch(1)
    steps = fast.step
    with torch.no_grad():
        assert torch.equal(fast(indices, offsets), stock(indices, offsets))
    assert fast.step == steps + 1  # FBGEMM's own forward ran (it counts its calls; the kernels' path does not)
    weights = torch.rand(indices.numel())
    out = fast(indices, offsets, per_sample_weights=weights)  # FBGEMM's forward and backward
    torch.testing.assert_close(out, stock(indices, offsets, per_sample_weights=weights))
    assert "recforge" not in type(out.grad_fn).__name__.lower() and "_Lookup" not in type(out.grad_fn).__name__


def test_an_id_outside_its_table_raises_naming_the_feature():
    fast = _tbe()
    ra.install(fast)
    indices, offsets, _ = _batch(2)
    indices = indices.clone()
    indices[-1] = 3000  # the last feature's table has 3000 rows
    with pytest.raises(RuntimeError, match=r"feature 2 looks up row 3000 of a table of 3000 rows"):
        fast(indices, offsets)


def test_offsets_that_are_not_features_times_batch_or_out_of_order_are_refused():
    fast = _tbe()
    with pytest.raises(ValueError, match="not features x batch"):
        ra.lookup(fast, torch.zeros(3, dtype=torch.long), torch.arange(5))
    offsets = torch.tensor([0, 2, 1, 3])  # 3 features x 1 bag, decreasing at bag 1
    with pytest.raises(RuntimeError, match="offsets decrease at bag 1"):
        ra.lookup(fast, torch.zeros(3, dtype=torch.long), offsets)
    with pytest.raises(RuntimeError, match="outside the 3 indices"):
        ra.lookup(fast, torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 2, 9]))


def test_a_feature_with_only_empty_bags_and_an_empty_batch():
    stock, fast = _tbe(), _tbe()
    ra.install(fast)
    indices, offsets, grad = _batch(3, batch=8)
    lens = offsets.diff()
    lens[8:16] = 0  # feature 1: every bag empty
    keep = torch.ones(indices.numel(), dtype=torch.bool)
    keep[int(offsets[8]):int(offsets[16])] = False
    indices, offsets = indices[keep], torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    for m in (stock, fast):
        m(indices, offsets).backward(grad)
    torch.testing.assert_close(fast.weights_host, stock.weights_host, rtol=1e-5, atol=1e-6)
    out = fast(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long))  # no bags at all
    assert out.shape == (0, sum(d for _, d in SPECS))
    out.backward(torch.zeros_like(out))
    torch.testing.assert_close(fast.weights_host, stock.weights_host, rtol=1e-5, atol=1e-6)


def test_unsupported_modules_are_named_and_left_alone(monkeypatch):
    sgd = _tbe(optimizer=EmbOptimType.EXACT_SGD)
    assert "optimizer" in ra.unsupported(sgd)
    assert not ra.install(sgd) and not getattr(sgd, ra.INSTALLED, False)
    shared = _tbe(specs=[(50, 8), (7, 8)], feature_table_map=[0, 0, 1])
    assert ra.unsupported(shared) == "features share tables"
    decay = _tbe(weight_decay=0.01)
    assert "weight decay" in ra.unsupported(decay)
    counter = _tbe()
    counter._used_rowwise_adagrad_with_counter = True  # as FBGEMM marks its counter-based modes
    assert "counters" in ra.unsupported(counter)
    assert ra.unsupported(_tbe()) is None
    monkeypatch.setitem(ra.LIBRARY._state, "ops", None)  # no compiler: FBGEMM's backward, and why
    assert "not available" in ra.unsupported(_tbe())
