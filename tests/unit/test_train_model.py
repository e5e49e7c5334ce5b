"""build_dlrm: both architectures, forward shape, deterministic init, argument checks."""
from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import ModelConfig
from recforge.train.model import EBC_PATH, build_dlrm

TABLES = [("C1", 40), ("C2", 7), ("C3", 300)]


def _kjt(ids: torch.Tensor) -> KeyedJaggedTensor:
    b, f = ids.shape
    return KeyedJaggedTensor(keys=[t for t, _ in TABLES], values=ids.t().reshape(-1),
                             lengths=torch.ones(b * f, dtype=torch.int32), stride=b)


def _inputs(b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(0, n, (b,), generator=g) for _, n in TABLES], 1)
    return torch.randn(b, 5, generator=g), _kjt(ids)


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_forward_gives_one_logit_per_row(arch):
    cfg = ModelConfig(arch=arch, embedding_dim=8, dense_arch=[16, 8], over_arch=[12, 1])
    model = build_dlrm(cfg, TABLES, num_dense=5, device="cpu")
    dense, kjt = _inputs(6)
    out = model(dense, kjt)
    assert out.shape == (6, 1)
    assert torch.isfinite(out).all()
    out.sum().backward()  # differentiable end to end
    ebc = model.get_submodule(EBC_PATH)
    assert isinstance(ebc, EmbeddingBagCollection)
    assert all(p.grad is not None for p in model.parameters())


def test_one_table_per_feature_named_after_it():
    model = build_dlrm(ModelConfig(), TABLES, num_dense=5)
    configs = model.get_submodule(EBC_PATH).embedding_bag_configs()
    assert [(c.name, c.num_embeddings, c.feature_names, c.embedding_dim) for c in configs] == [
        (name, rows, [name], 16) for name, rows in TABLES
    ]


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_init_is_deterministic_under_manual_seed(arch):
    cfg = ModelConfig(arch=arch)
    torch.manual_seed(3)
    a = build_dlrm(cfg, TABLES, 5).state_dict()
    torch.manual_seed(3)
    b = build_dlrm(cfg, TABLES, 5).state_dict()
    torch.manual_seed(4)
    c = build_dlrm(cfg, TABLES, 5).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_dcn_differs_from_dlrm_interaction():
    dlrm = build_dlrm(ModelConfig(arch="dlrm"), TABLES, 5)
    dcn = build_dlrm(ModelConfig(arch="dlrm_dcn", dcn_num_layers=3), TABLES, 5)
    assert type(dlrm.inter_arch).__name__ == "InteractionArch"
    assert type(dcn.inter_arch).__name__ == "InteractionDCNArch"


@pytest.mark.parametrize(
    "tables, num_dense, match",
    [([], 5, "at least one sparse"), ([("a", 3), ("a", 4)], 5, "unique"), ([("a", 0)], 5, "at least 1"),
     ([("a", 3)], 0, "num_dense")],
)
def test_bad_arguments_raise(tables, num_dense, match):
    with pytest.raises(ValueError, match=match):
        build_dlrm(ModelConfig(), tables, num_dense)
