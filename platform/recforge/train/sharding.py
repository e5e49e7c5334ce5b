"""Shard a DLRM with TorchRec's planner and build its optimizers.

fused_embeddings=True: the EBC params get an optimizer applied in backward
(torchrec.optim.apply_optimizer_in_backward), so the planner's FUSED kernel (FBGEMM TBE) updates
embedding rows inside the backward pass; no embedding gradient is ever materialized.
fused_embeddings=False: the plain (dense) EBC kernel; gradients are full dense tensors and a regular
optimizer steps them. torchrec 1.8 allows the DENSE kernel only with data_parallel sharding.

Dense params (bottom/over arch, DDP-replicated) always use Adam(dense_lr).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recforge.config import TrainConfig
from recforge.train.model import EBC_PATH

log = logging.getLogger(__name__)

EMBEDDING_EPS = 1e-8  # same eps for the fused (FBGEMM) and the plain optimizers, so both paths match
EMBEDDING_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "rowwise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
}
DENSE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}
ALL_SHARDING_TYPES = ["table_wise", "column_wise", "data_parallel"]


@dataclass
class ShardedModel:
    model: DistributedModelParallel
    optimizer: KeyedOptimizer
    plan: ShardingPlan

    def plan_summary(self) -> dict[str, dict[str, Any]]:
        """{table: {sharding_type, compute_kernel, ranks}} as the planner decided."""
        return plan_summary(self.plan)


def plan_summary(plan: ShardingPlan) -> dict[str, dict[str, Any]]:
    module_plan = plan.plan.get(EBC_PATH, {})
    return {
        table: {"sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel, "ranks": list(ps.ranks or [])}
        for table, ps in module_plan.items()
    }


def _optimizer_kwargs(name: str, lr: float) -> dict[str, Any]:
    return {"lr": lr} if name == "sgd" else {"lr": lr, "eps": EMBEDDING_EPS}


def sharding_constraints(train: TrainConfig, table_names: list[str]) -> dict[str, ParameterConstraints]:
    if not train.fused_embeddings and train.sharding in ("table_wise", "column_wise"):
        raise ValueError(
            f"train.sharding={train.sharding!r} needs fused_embeddings=true: torchrec runs the dense embedding "
            "kernel only with data_parallel sharding"
        )
    types = ALL_SHARDING_TYPES if train.sharding == "auto" else [train.sharding]
    if not train.fused_embeddings:
        types, kernels = ["data_parallel"], ["dense"]
    elif train.sharding == "data_parallel":
        kernels = ["dense"]  # data_parallel has no fused kernel; its tables get a regular optimizer
    elif train.sharding == "auto":
        kernels = ["fused", "dense"]  # dense only exists for the data_parallel choice
    else:
        kernels = ["fused"]
    return {t: ParameterConstraints(sharding_types=list(types), compute_kernels=list(kernels)) for t in table_names}


def shard_model(
    model: torch.nn.Module,
    train: TrainConfig,
    *,
    world_size: int,
    device: torch.device,
    pg: dist.ProcessGroup | None = None,
    embedding_optimizer: str = "rowwise_adagrad",
    dense_optimizer: str = "adam",
) -> ShardedModel:
    """Wrap `model` (an unsharded DLRM from build_dlrm) in DMP; needs an initialized process group.

    The sharded model starts from `model`'s weights on every rank (torchrec copies them only for
    CUDA modules, so they are loaded back explicitly here).
    """
    if embedding_optimizer not in EMBEDDING_OPTIMIZERS:
        raise ValueError(f"embedding_optimizer: {embedding_optimizer!r}; choose one of {sorted(EMBEDDING_OPTIMIZERS)}")
    if dense_optimizer not in DENSE_OPTIMIZERS:
        raise ValueError(f"dense_optimizer: {dense_optimizer!r}; choose one of {sorted(DENSE_OPTIMIZERS)}")
    pg = pg or dist.GroupMember.WORLD
    ebc = model.get_submodule(EBC_PATH)
    table_names = [c.name for c in ebc.embedding_bag_configs()]
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    emb_cls = EMBEDDING_OPTIMIZERS[embedding_optimizer]
    emb_kwargs = _optimizer_kwargs(embedding_optimizer, train.embedding_lr)

    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world_size),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology, constraints=sharding_constraints(train, table_names), debug=False
    )
    sharders = [EmbeddingBagCollectionSharder()]
    plan = planner.collective_plan(model, sharders, pg)
    # The optimizer goes into backward only for tables the planner gave the FUSED kernel: a
    # data_parallel table keeps the original parameter, where an in-backward hook would step it on
    # the local gradient before DDP's all-reduce (and again in the regular optimizer).
    for table, info in plan_summary(plan).items():
        if info["compute_kernel"] == "fused":
            # a fresh dict each time: the sharder rewrites these kwargs in place (lr -> learning_rate)
            apply_optimizer_in_backward(emb_cls, [ebc.embedding_bags[table].weight], dict(emb_kwargs))
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    dmp.load_state_dict(init_state)

    optimizers: list[KeyedOptimizer] = []
    if dmp.fused_optimizer.params:
        optimizers.append(dmp.fused_optimizer)
    rest = dict(in_backward_optimizer_filter(dmp.named_parameters(), include=False))
    emb = {k: p for k, p in rest.items() if k.startswith(EBC_PATH + ".")}
    dense = {k: p for k, p in rest.items() if k not in emb}
    if emb:
        optimizers.append(KeyedOptimizerWrapper(emb, lambda ps: emb_cls(ps, **dict(emb_kwargs))))
    if dense:
        d_cls = DENSE_OPTIMIZERS[dense_optimizer]
        optimizers.append(KeyedOptimizerWrapper(dense, lambda ps: d_cls(ps, lr=train.dense_lr)))
    sharded = ShardedModel(model=dmp, optimizer=CombinedOptimizer(optimizers), plan=plan)
    log.info("sharding plan: %s", sharded.plan_summary())
    return sharded
