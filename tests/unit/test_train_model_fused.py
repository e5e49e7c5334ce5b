"""build_dlrm(fused=True), the trainer's model: the same weights, state dict, logits and gradients as torchrec's
DLRM; the fast sparse arch falls back when the KeyedTensor's keys are not in feature order; interaction_kind."""
from __future__ import annotations

import pytest
import torch
from torchrec.models.dlrm import InteractionArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recforge.config import ModelConfig
from recforge.train.model import FusedInteractionArch, KeyOrderSparseArch, build_dlrm, interaction_kind
from recforge_kernels.interaction import extension

TABLES = [(f"C{i}", 20 + 3 * i) for i in range(9)]
CFG = ModelConfig(embedding_dim=8, dense_arch=[16, 8], over_arch=[12, 1])


def _inputs(b: int, multi_hot: bool = False):
    g = torch.Generator().manual_seed(1)
    lengths = (torch.randint(0, 3, (b * len(TABLES),), generator=g) if multi_hot
               else torch.ones(b * len(TABLES), dtype=torch.int64))
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor(keys=[t for t, _ in TABLES], values=values, lengths=lengths.to(torch.int32), stride=b)
    return torch.randn(b, 5, generator=g), kjt


def _pair(arch: str = "dlrm"):
    cfg = CFG.model_copy(update={"arch": arch})
    torch.manual_seed(3)
    stock = build_dlrm(cfg, TABLES, 5)
    torch.manual_seed(3)
    fused = build_dlrm(cfg, TABLES, 5, fused=True)
    return stock, fused


@pytest.mark.parametrize("arch,multi_hot", [("dlrm", False), ("dlrm", True), ("dlrm_dcn", False)])
def test_fused_model_equals_torchrecs(arch, multi_hot):
    stock, fused = _pair(arch)
    assert isinstance(fused.sparse_arch, KeyOrderSparseArch)
    assert isinstance(fused.inter_arch, FusedInteractionArch) == (arch == "dlrm")
    a, b = stock.state_dict(), fused.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)  # same names, same initial weights
    dense, kjt = _inputs(21, multi_hot)
    out_s, out_f = stock(dense, kjt), fused(dense, kjt)
    torch.testing.assert_close(out_f, out_s, rtol=1e-5, atol=1e-6)
    out_s.square().sum().backward()
    out_f.square().sum().backward()
    grads = dict(fused.named_parameters())
    for name, p in stock.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_stock_state_dict_loads_into_the_fused_model():
    stock, fused = _pair()
    with torch.no_grad():
        for p in stock.parameters():
            p.add_(0.5)
    fused.load_state_dict(stock.state_dict())  # strict: checkpoints move between the two
    dense, kjt = _inputs(4)
    torch.testing.assert_close(fused(dense, kjt), stock(dense, kjt), rtol=1e-5, atol=1e-6)


class _PermutedEBC(torch.nn.Module):
    """Returns a KeyedTensor whose keys are in reverse feature order (as a sharded EBC's output may be)."""

    def __init__(self, names: list[str], dim: int) -> None:
        super().__init__()
        self.names, self.dim = names, dim
        self.tables = torch.nn.Parameter(torch.randn(len(names), dim))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        b = features.stride()
        keys = self.names[::-1]
        values = torch.cat([self.tables[self.names.index(k)].expand(b, self.dim) for k in keys], dim=1)
        return KeyedTensor(keys=keys, length_per_key=[self.dim] * len(keys), values=values)


def test_sparse_arch_reorders_keys_out_of_feature_order():
    """As a sharded EBC returns them: grouped by sharding type and rank, not in feature order."""
    stock, fused = _pair()
    arch = fused.sparse_arch
    names = list(arch.sparse_feature_names)
    arch.embedding_bag_collection = _PermutedEBC(names, 8)
    _, kjt = _inputs(3)
    out = arch(kjt)
    assert out.shape == (3, len(names), 8)
    for i in range(len(names)):  # feature i's column is table i's vector, whatever order the keys came in
        assert torch.equal(out[:, i], arch.embedding_bag_collection.tables[i].detach().expand(3, 8))
    out.square().sum().backward()  # each table's gradient reaches it through the reordering
    grads = arch.embedding_bag_collection.tables.grad
    torch.testing.assert_close(grads, 2 * 3 * arch.embedding_bag_collection.tables.detach())


def test_sparse_arch_concatenates_when_keys_are_not_one_per_feature():
    stock, fused = _pair()
    arch = fused.sparse_arch
    names = list(arch.sparse_feature_names)
    ebc = _PermutedEBC(names, 8)
    arch.embedding_bag_collection = ebc
    assert arch._order(names[::-1][:-1] + ["other"], [8] * len(names)) is None  # a key that is no feature
    assert arch._order(names[::-1], [8] * (len(names) - 1) + [4]) is None  # a key of another width
    _, kjt = _inputs(2)
    arch._orders[tuple(names[::-1])] = None  # as if the keys were refused: torchrec's concatenation runs
    out = arch(kjt)
    for i in range(len(names)):
        assert torch.equal(out[:, i], ebc.tables[i].detach().expand(2, 8))


def test_interaction_kind_names_what_runs():
    stock, fused = _pair()
    assert interaction_kind(stock) == "torchrec"
    assert interaction_kind(fused) == ("cpp" if extension() is not None else "torch")
    _, dcn = _pair("dlrm_dcn")
    assert interaction_kind(dcn) == "torchrec"


def test_fused_interaction_arch_is_a_torchrec_interaction_arch():
    arch = FusedInteractionArch(num_sparse_features=4)
    assert isinstance(arch, InteractionArch) and not list(arch.state_dict())  # nothing persistent added
    dense = torch.randn(3, 8)
    assert torch.equal(FusedInteractionArch(0)(dense, torch.empty(3, 0, 8)), dense)
