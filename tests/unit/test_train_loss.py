"""Loss normalization: padding rows change nothing; split over ranks and averaged, gradients equal the global mean."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import ModelConfig
from recforge.train.loop.loss import step_loss, weighted_bce_sum
from recforge.train.model import build_dlrm

TABLES = [("C1", 30), ("C2", 11)]
CFG = ModelConfig(embedding_dim=4, dense_arch=[8, 4], over_arch=[8, 1])


def _model():
    torch.manual_seed(0)
    return build_dlrm(CFG, TABLES, num_dense=3)


def _data(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, 3, generator=g)
    ids = torch.stack([torch.randint(0, r, (n,), generator=g) for _, r in TABLES], 1)
    labels = (torch.rand(n, generator=g) < 0.3).float()
    return dense, ids, labels


def _kjt(ids):
    b, f = ids.shape
    return KeyedJaggedTensor(keys=[t for t, _ in TABLES], values=ids.t().reshape(-1),
                             lengths=torch.ones(b * f, dtype=torch.int32), stride=b)


def _pad(dense, ids, labels, n):
    pad = n - dense.shape[0]
    w = torch.cat([torch.ones(dense.shape[0]), torch.zeros(pad)])
    # padding rows get arbitrary (here: nonzero) content: only the weight may neutralize them
    return (torch.cat([dense, torch.full((pad, 3), 7.0)]), torch.cat([ids, torch.ones(pad, 2, dtype=torch.long)]),
            torch.cat([labels, torch.ones(pad)]), w)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_padded_batch_matches_unpadded_loss_and_gradients():
    dense, ids, labels = _data(5)
    ref = _model()
    ref_loss = F.binary_cross_entropy_with_logits(ref(dense, _kjt(ids)).squeeze(1), labels)
    ref_loss.backward()

    m = _model()
    pd, pi, pl, w = _pad(dense, ids, labels, 8)
    loss, local_sum = step_loss(m(pd, _kjt(pi)), pl, w, global_weight=5.0, world_size=1)
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert local_sum.item() == pytest.approx(5 * ref_loss.item(), rel=1e-6)
    g, rg = _grads(m), _grads(ref)
    for n in rg:
        torch.testing.assert_close(g[n], rg[n], rtol=1e-5, atol=1e-7)


def test_ranks_averaged_like_ddp_give_the_global_mean_gradient():
    """Rank r's loss = sum(w * bce) / W_global * world_size; averaging the ranks' gradients (DDP)
    gives the gradient of the mean over all real rows, however unevenly they are split."""
    dense, ids, labels = _data(9)
    ref = _model()
    F.binary_cross_entropy_with_logits(ref(dense, _kjt(ids)).squeeze(1), labels).backward()

    world, batch = 3, 6
    splits = [slice(0, 6), slice(6, 9), slice(9, 9)]  # 6 rows, 3 rows, and a rank without data
    summed = None
    for sl in splits:
        m = _model()
        pd, pi, pl, w = _pad(dense[sl], ids[sl], labels[sl], batch)
        loss, _ = step_loss(m(pd, _kjt(pi)), pl, w, global_weight=9.0, world_size=world)
        loss.backward()
        g = _grads(m)
        summed = g if summed is None else {n: summed[n] + g[n] for n in g}
    for n, rg in _grads(ref).items():
        torch.testing.assert_close(summed[n] / world, rg, rtol=1e-5, atol=1e-7)


def test_weighted_sum_and_argument_checks():
    logits = torch.tensor([[0.0], [2.0], [-1.0]])
    labels = torch.tensor([1.0, 0.0, 1.0])
    w = torch.tensor([1.0, 1.0, 0.0])
    expected = F.binary_cross_entropy_with_logits(logits[:2, 0], labels[:2], reduction="sum")
    assert weighted_bce_sum(logits, labels, w).item() == pytest.approx(expected.item())
    with pytest.raises(ValueError, match="shape mismatch"):
        weighted_bce_sum(logits, labels[:2], w[:2])
    with pytest.raises(ValueError, match="global_weight"):
        step_loss(logits, labels, w, 0.0, 1)
