"""The planner constraints derived from TrainConfig.sharding / fused_embeddings (DMP itself: integration tests)."""
from __future__ import annotations

import pytest

from recforge.config import TrainConfig
from recforge.train.sharding import sharding_constraints


@pytest.mark.parametrize(
    "sharding, fused, types, kernels",
    [
        ("auto", True, ["table_wise", "column_wise", "data_parallel"], ["fused", "dense"]),
        ("table_wise", True, ["table_wise"], ["fused"]),
        ("column_wise", True, ["column_wise"], ["fused"]),
        ("data_parallel", True, ["data_parallel"], ["dense"]),
        ("auto", False, ["data_parallel"], ["dense"]),
        ("data_parallel", False, ["data_parallel"], ["dense"]),
    ],
)
def test_constraints(sharding, fused, types, kernels):
    cons = sharding_constraints(TrainConfig(sharding=sharding, fused_embeddings=fused), ["C1", "C2"])
    assert sorted(cons) == ["C1", "C2"]
    for c in cons.values():
        assert c.sharding_types == types
        assert c.compute_kernels == kernels


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_plain_kernel_with_model_parallel_sharding_is_refused(sharding):
    with pytest.raises(ValueError, match="data_parallel"):
        sharding_constraints(TrainConfig(sharding=sharding, fused_embeddings=False), ["C1"])


# ---------------------------------------------------------------------------------------------
# shard_model(placements=...): the mapping's placements drive the real sharding
# ---------------------------------------------------------------------------------------------
MIX_TABLES = [("C1", 60), ("C2", 400), ("C3", 9), ("C4", 100)]
MIX_DENSE, MIX_BATCH, MIX_DIM = 3, 4, 8


def _mix_placements():
    from recforge.train.placement import Placement

    return {"C1": Placement("table_wise", (1,)), "C2": Placement("column_wise", (0, 1)),
            "C3": Placement("data_parallel", (0, 1)), "C4": Placement("table_wise", (0,))}


def _mix_model():
    import torch

    from recforge.config import ModelConfig
    from recforge.train.model import build_dlrm

    torch.manual_seed(0)
    cfg = ModelConfig(arch="dlrm", embedding_dim=MIX_DIM, dense_arch=[8, MIX_DIM], over_arch=[8, 1])
    return build_dlrm(cfg, MIX_TABLES, MIX_DENSE)


def _mix_data():
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(3)
    n = 2 * MIX_BATCH
    dense = torch.randn(n, MIX_DENSE, generator=g)
    ids = torch.stack([torch.randint(0, r, (n,), generator=g) for _, r in MIX_TABLES], 1)
    labels = (torch.rand(n, generator=g) < 0.5).float()

    def kjt(rows):
        return KeyedJaggedTensor(keys=[t for t, _ in MIX_TABLES], values=ids[rows].t().reshape(-1).contiguous(),
                                 lengths=torch.ones(len(rows) * len(MIX_TABLES), dtype=torch.int32), stride=len(rows))

    return dense, kjt, labels


def _mix_worker(rank, world, port, out_dir):
    import os

    import torch
    import torch.distributed as dist

    from recforge.config import TrainConfig
    from recforge.train.loop.loss import step_loss
    from recforge.train.sharding import shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train = TrainConfig(embedding_lr=50.0, dense_lr=0.1)  # sgd on small embedding gradients
        # sgd: exact, and sensitive to how each kind scales its gradient (rowwise_adagrad keeps its row state per
        # column shard, so a column_wise table does not step like the unsharded one there)
        sm = shard_model(_mix_model(), train, world_size=world, device=torch.device("cpu"), dense_optimizer="sgd",
                         embedding_optimizer="sgd", placements=_mix_placements())
        dense, kjt, labels = _mix_data()
        mine = list(range(rank * MIX_BATCH, (rank + 1) * MIX_BATCH))
        loss, _ = step_loss(sm.model(dense[mine], kjt(mine)), labels[mine], torch.ones(MIX_BATCH),
                            float(2 * MIX_BATCH), world)
        loss.backward()
        sm.optimizer.step()
        sm.optimizer.zero_grad()
        with torch.no_grad():
            pred = sm.model(dense[mine], kjt(mine))
        torch.save({"pred": pred, "plan": sm.plan_summary()}, f"{out_dir}/rank{rank}.pt")
        try:  # a rank that passes other placements: every rank fails, naming the mismatch
            other = {**_mix_placements(), "C4": _mix_placements()["C1"]} if rank else _mix_placements()
            shard_model(_mix_model(), train, world_size=world, device=torch.device("cpu"), placements=other)
            err = None
        except ValueError as e:
            err = str(e)
        torch.save(err, f"{out_dir}/err{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_placements_drive_the_distributed_sharding_and_train_like_one_process(tmp_path):
    import socket

    import torch
    import torch.multiprocessing as mp
    import torch.nn.functional as F

    from recforge.rap.mapping.milp import from_torchrec

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_mix_worker, args=(2, port, str(tmp_path)), nprocs=2)

    dense, kjt, labels = _mix_data()
    rows = list(range(2 * MIX_BATCH))

    def reference(embedding_lr):  # planner-free: one process, one SGD step on the union of both ranks' rows
        model = _mix_model()
        emb = [p for n, p in model.named_parameters() if "embedding_bags" in n]
        dense_p = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
        opts = [torch.optim.SGD(emb, lr=embedding_lr), torch.optim.SGD(dense_p, lr=0.1)]
        F.binary_cross_entropy_with_logits(model(dense[rows], kjt(rows)).squeeze(1), labels).backward()
        for o in opts:
            o.step()
        with torch.no_grad():
            return model(dense[rows], kjt(rows))

    ref = reference(50.0)
    assert (ref - reference(0.0)).abs().max() > 1e-2  # the embedding step shows in the predictions

    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in range(2):
        assert from_torchrec(got[r]["plan"]) == _mix_placements()
        assert {t: v["compute_kernel"] for t, v in got[r]["plan"].items()} == {
            "C1": "fused", "C2": "fused", "C3": "dense", "C4": "fused"}
    torch.testing.assert_close(torch.cat([got[0]["pred"], got[1]["pred"]]), ref, rtol=1e-4, atol=1e-5)
    errs = [torch.load(tmp_path / f"err{r}.pt") for r in range(2)]
    assert all(e is not None and "ranks [1]" in e and "differ" in e for e in errs), errs


def _check(placements, world=2, **train):
    from recforge.train.sharding import check_placements

    check_placements(placements, {"C1": 8, "C2": 8, "C3": 12}, world, TrainConfig(**train))


def test_placement_checks_name_the_table():
    from recforge.train.placement import Placement

    tw, cw, dp = Placement("table_wise", (1,)), Placement("column_wise", (0, 1)), Placement("data_parallel", (0, 1))
    _check({"C1": tw, "C2": cw, "C3": dp})
    _check({"C1": dp, "C2": dp, "C3": dp}, fused_embeddings=False)
    with pytest.raises(ValueError, match=r"tables \['C3'\] of the model have none, and \['X'\] are not"):
        _check({"C1": tw, "C2": cw, "X": dp})
    with pytest.raises(ValueError, match=r"'C1'.*outside 0\.\.1"):
        _check({"C1": Placement("table_wise", (2,)), "C2": cw, "C3": dp})
    with pytest.raises(ValueError, match=r"'C3': column_wise over ranks \[0, 1\].*12 columns"):
        _check({"C1": tw, "C2": cw, "C3": cw})  # 12 columns -> shards of 6
    with pytest.raises(ValueError, match=r"'C2': column_wise.*distinct"):
        _check({"C1": tw, "C2": Placement("column_wise", (0, 0)), "C3": dp})
    with pytest.raises(ValueError, match=r"'C1' is table_wise\[1\], which needs the fused kernel.*fused_embed"):
        _check({"C1": tw, "C2": dp, "C3": dp}, fused_embeddings=False)
    with pytest.raises(ValueError, match=r"'C2' is column_wise\[0, 1\].*train.sharding='table_wise'"):
        _check({"C1": tw, "C2": cw, "C3": tw}, sharding="table_wise")
    with pytest.raises(ValueError, match=r"'C3': data_parallel spans every rank \[0, 1\], got \[0\]"):
        _check({"C1": tw, "C2": cw, "C3": Placement("data_parallel", (0,))})
    with pytest.raises(ValueError, match=r"'C1': table_wise takes one rank"):
        _check({"C1": Placement("table_wise", (0, 1)), "C2": cw, "C3": dp})


def test_make_planner_pins_a_tables_sharding_type_and_names_an_unknown_table():
    from recforge.train.sharding import make_planner

    planner = make_planner(TrainConfig(), ["C1", "C2"], 2, "cpu", pinned={"C1": "column_wise", "C2": "data_parallel"})
    constraints = planner._constraints  # what the planner enumerates from
    assert constraints["C1"].sharding_types == ["column_wise"] and constraints["C1"].compute_kernels == ["fused"]
    assert constraints["C2"].sharding_types == ["data_parallel"] and constraints["C2"].compute_kernels == ["dense"]
    with pytest.raises(ValueError, match="'C9' is not a table of the model"):
        make_planner(TrainConfig(), ["C1"], 2, "cpu", pinned={"C9": "table_wise"})
