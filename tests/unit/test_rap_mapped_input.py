"""RAP's mapping on the training side (recforge.rap.mapping.mapped_input), 2 gloo ranks on CPU.

Two DMPs from the same weights train the same steps: one through torchrec's input all-to-all (every rank its local
batch), one with MappedFeatures (each rank the global batch of the tables it holds, its local batch of the
data_parallel ones). Logits, losses and every weight afterwards must be equal; a placement where a rank holds no
table exercises the empty global input.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from recforge.train.distributed import free_port

TABLES = [("C1", 50), ("C2", 70), ("C3", 30), ("C4", 20)]
NUM_DENSE, DIM, B, WORLD = 3, 8, 5, 2
PLACEMENTS = {
    "spread": {"C1": ("table_wise", (0,)), "C2": ("table_wise", (1,)), "C3": ("column_wise", (0, 1)),
               "C4": ("data_parallel", (0, 1))},
    "rank1_holds_none": {"C1": ("table_wise", (0,)), "C2": ("table_wise", (0,)), "C3": ("data_parallel", (0, 1)),
                         "C4": ("data_parallel", (0, 1))},
}


def _kjt(ids: torch.Tensor, names: list[str], first_row: int = 0):
    """Rows first_row.. of the step's data; variable lengths (0..2 ids) so jagged layouts are exercised: the id of
    global row g repeats g % 3 times (the same row has the same ids whichever rank builds it)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    cols = [t for t, _ in TABLES]
    sel = ids[:, [cols.index(n) for n in names]]
    b = ids.shape[0]
    reps = [(first_row + i) % 3 for i in range(b)]
    lengths = torch.tensor([reps[i] for _ in names for i in range(b)], dtype=torch.int32)
    values = torch.cat([sel[i, j].repeat(reps[i]) for j in range(len(names)) for i in range(b)])
    return KeyedJaggedTensor(keys=list(names), values=values.long(), lengths=lengths, stride=b)


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    dense = torch.randn(WORLD * B, NUM_DENSE, generator=g)
    ids = torch.stack([torch.randint(0, r, (WORLD * B,), generator=g) for _, r in TABLES], 1)
    labels = (torch.rand(WORLD * B, generator=g) < 0.5).float()
    return dense, ids, labels


def _dmp(placements, rank):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from recforge.config import ModelConfig
    from recforge.train.model import EBC_PATH, build_dlrm
    from recforge.train.placement import Placement
    from recforge.train.sharding import to_torchrec

    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(arch="dlrm", embedding_dim=DIM, dense_arch=[8, DIM], over_arch=[8, 1]),
                       TABLES, NUM_DENSE)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ebc = model.get_submodule(EBC_PATH)
    pl = {t: Placement(k, r) for t, (k, r) in placements.items()}
    for t, p in pl.items():
        if p.kind != "data_parallel":
            apply_optimizer_in_backward(RowWiseAdagrad, [ebc.embedding_bags[t].weight], {"lr": 0.1})
    plan = ShardingPlan({EBC_PATH: to_torchrec(pl, ebc, WORLD)})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                   sharders=[EmbeddingBagCollectionSharder()])
    dmp.load_state_dict(init)
    dense_params = [p for n, p in dmp.named_parameters() if not getattr(p, "_in_backward_optimizers", None)]
    return dmp, torch.optim.SGD(dense_params, lr=0.1)


def _local_state(model):
    return {k: _dense(v).detach().clone() for k, v in model.state_dict().items()}


def _worker(rank, port, out_dir, case):
    import torch.distributed as dist
    import torch.nn.functional as F

    from recforge.rap.mapping.mapped_input import MappedFeatures, MappedInput, _sharded_ebc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        placements = PLACEMENTS[case]
        names = [t for t, _ in TABLES]
        base, base_opt = _dmp(placements, rank)
        mapped_model, mapped_opt = _dmp(placements, rank)
        mapped = MappedInput.install(mapped_model, rank, WORLD)
        out = {"global": mapped.global_features, "local": mapped.local_features, "logits": [],
               "init_state": _local_state(mapped_model)}
        for step in range(3):
            dense, ids, labels = _data(step)
            mine = slice(rank * B, (rank + 1) * B)
            results = []
            for model, opt, sparse in (
                (base, base_opt, _kjt(ids[mine], names, rank * B)),
                (mapped_model, mapped_opt, MappedFeatures(
                    local=_kjt(ids[mine], mapped.local_features, rank * B) if mapped.local_features else None,
                    global_=_kjt(ids, mapped.global_features) if mapped.global_features else None,
                    batch_size=B)),
            ):
                logits = model(dense[mine], sparse).squeeze(1)
                F.binary_cross_entropy_with_logits(logits, labels[mine]).backward()
                opt.step()
                opt.zero_grad()
                results.append(logits.detach())
            out["logits"].append(results)
        out["base_state"], out["mapped_state"] = _local_state(base), _local_state(mapped_model)
        # torchrec builds its input all-to-all on the first input_dist call: the mapped model never made one
        out["input_dist_used"] = [not m.sebc._has_uninitialized_input_dist
                                  for m in (MappedInput(_sharded_ebc(base), rank, WORLD), mapped)]
        torch.save(out, Path(out_dir) / f"{case}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _dense(t):
    if hasattr(t, "local_shards"):  # a ShardedTensor: this rank's shards (none when it holds no part of the table)
        return torch.cat([torch.empty(0)] + [s.tensor.reshape(-1) for s in t.local_shards()])
    return t


@pytest.mark.parametrize("case", sorted(PLACEMENTS))
def test_mapped_input_trains_like_the_input_all_to_all(tmp_path, case):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(free_port(), str(tmp_path), case), nprocs=WORLD)
    for rank in range(WORLD):
        out = torch.load(tmp_path / f"{case}-{rank}.pt", weights_only=False)
        held = {t for t, (k, r) in PLACEMENTS[case].items() if k != "data_parallel" and rank in r}
        assert out["input_dist_used"] == [True, False]
        assert set(out["global"]) == held
        assert set(out["local"]) == {t for t, (k, _) in PLACEMENTS[case].items() if k == "data_parallel"}
        for base_logits, mapped_logits in out["logits"]:
            torch.testing.assert_close(mapped_logits, base_logits, rtol=0, atol=1e-6)
        assert out["base_state"].keys() == out["mapped_state"].keys()
        for k, v in out["base_state"].items():
            torch.testing.assert_close(_dense(out["mapped_state"][k]), _dense(v), rtol=0, atol=1e-6, msg=k)
        # training moved every table's weights: the comparison is not of two untouched models
        for k, v in out["init_state"].items():
            if "embedding_bags" in k and v.numel():
                assert not torch.equal(_dense(out["mapped_state"][k]), _dense(v)), k


def test_mapped_features_are_checked(tmp_path):
    from recforge.rap.mapping.mapped_input import MappedInputError, _select

    kjt = _kjt(torch.zeros(4, len(TABLES), dtype=torch.long), ["C1", "C2"])
    with pytest.raises(MappedInputError, match="C3"):
        _select(kjt, ["C1", "C3"], 4, "global")
    with pytest.raises(MappedInputError, match="4 rows, expected 8"):
        _select(kjt, ["C1"], 8, "global")
    with pytest.raises(MappedInputError, match="none given"):
        _select(None, ["C1"], 4, "local")
    assert _select(kjt, ["C2", "C1"], 4, "global").keys() == ["C2", "C1"]
    assert _select(None, [], 8, "global").stride() == 8
