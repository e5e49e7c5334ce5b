"""Shard a DLRM with TorchRec's planner and build its optimizers.

fused_embeddings=True: the EBC params get an optimizer applied in backward
(torchrec.optim.apply_optimizer_in_backward), so the planner's FUSED kernel (FBGEMM TBE) updates
embedding rows inside the backward pass; no embedding gradient is ever materialized.
fused_embeddings=False: the plain (dense) EBC kernel; gradients are full dense tensors and a regular
optimizer steps them. torchrec 1.8 allows the DENSE kernel only with data_parallel sharding.

Dense params (bottom/over arch, DDP-replicated) use TrainConfig.dense_optimizer (Adam) at dense_lr.

shard_model(..., placements=...): the plan comes from given per-table placements (recforge.train.placement, e.g. the
RAP mapping MILP's choice) instead of the planner; table_wise / column_wise get the FUSED kernel, data_parallel the
dense one, under the same constraints the planner gets from TrainConfig (sharding_constraints).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, data_parallel, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from recforge.config import TrainConfig
from recforge.train.dense_sync import DenseSync, ddp_modules, use_dense_grad_exchange
from recforge.train.embedding_update import EmbeddingUpdate, embedding_update_kind, use_rowwise_adagrad_kernel
from recforge.train.model import EBC_PATH
from recforge.train.placement import Placement

log = logging.getLogger(__name__)

EMBEDDING_EPS = 1e-8  # same eps for the fused (FBGEMM) and the plain optimizers, so both paths match
EMBEDDING_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "rowwise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
}


def fused_adam(params, lr: float) -> torch.optim.Optimizer:
    """Adam with torch's fused kernel (one pass over each parameter; CPU and CUDA): the same update as the
    default multi-tensor loop, ~2x less optimizer time on the small dense nets here (docs/performance.md)."""
    return torch.optim.Adam(params, lr=lr, fused=True)


# called as cls(params, lr=...): Optimizer.__init__ itself takes (params, defaults)
DENSE_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adam": fused_adam, "sgd": torch.optim.SGD}
ALL_SHARDING_TYPES = ["table_wise", "column_wise", "data_parallel"]


@dataclass
class ShardedModel:
    model: DistributedModelParallel
    optimizer: KeyedOptimizer
    plan: ShardingPlan
    embedding_update: EmbeddingUpdate = "fbgemm"  # which kernel updates the fused tables (train.rowwise_adagrad_kernel)
    dense_sync: DenseSync = "allreduce"  # what averages the dense gradients (train.dense_grad_exchange)

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
    embedding_optimizer: str | None = None,
    dense_optimizer: str | None = None,
    placements: Mapping[str, Placement] | None = None,
) -> ShardedModel:
    """Wrap `model` (an unsharded DLRM from build_dlrm) in DMP; needs an initialized process group.

    The sharded model starts from `model`'s weights on every rank (torchrec copies them only for
    CUDA modules, so they are loaded back explicitly here).

    placements: {table: Placement} for every table of the model; the plan is built from
    them (to_torchrec), not by the planner. Every rank must pass the same placements (as every rank
    calls shard_model collectively): they are compared across `pg` and a mismatch raises on all ranks.
    Checked first (ValueError naming the table): exactly the model's tables, ranks < world_size, column_wise
    over distinct ranks into equal shards of a multiple of 4 columns, each kind allowed by
    sharding_constraints(train) (table_wise / column_wise need fused_embeddings).
    """
    embedding_optimizer = embedding_optimizer or train.embedding_optimizer  # an argument overrides the config
    dense_optimizer = dense_optimizer or train.dense_optimizer
    if embedding_optimizer not in EMBEDDING_OPTIMIZERS:
        raise ValueError(f"embedding_optimizer: {embedding_optimizer!r}; choose one of {sorted(EMBEDDING_OPTIMIZERS)}")
    if dense_optimizer not in DENSE_OPTIMIZERS:
        raise ValueError(f"dense_optimizer: {dense_optimizer!r}; choose one of {sorted(DENSE_OPTIMIZERS)}")
    pg = pg or dist.GroupMember.WORLD
    ebc: EmbeddingBagCollection = model.get_submodule(EBC_PATH)
    table_names = [c.name for c in ebc.embedding_bag_configs()]
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    emb_cls = EMBEDDING_OPTIMIZERS[embedding_optimizer]
    emb_kwargs = _optimizer_kwargs(embedding_optimizer, train.embedding_lr)

    sharders = [EmbeddingBagCollectionSharder()]
    if placements is None:
        plan = make_planner(train, table_names, world_size, device.type).collective_plan(model, sharders, pg)
    else:
        plan = placement_plan(ebc, placements, train, world_size, device.type, pg)
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
    update = use_rowwise_adagrad_kernel(dmp) if train.rowwise_adagrad_kernel else embedding_update_kind(dmp)
    sync: DenseSync = (use_dense_grad_exchange(dmp) if train.dense_grad_exchange
                       else "allreduce" if ddp_modules(dmp) else "none")
    sharded = ShardedModel(model=dmp, optimizer=CombinedOptimizer(optimizers), plan=plan, embedding_update=update,
                           dense_sync=sync)
    log.info("sharding plan: %s; fused tables updated by %s; dense gradients averaged by %s",
             sharded.plan_summary(), update, sync)
    return sharded


def make_planner(train: TrainConfig, table_names: list[str], world_size: int,
                 device_type: str, pinned: Mapping[str, str] | None = None) -> EmbeddingShardingPlanner:
    """TorchRec's planner as shard_model runs it (also the baseline RAP's mapping is compared with). `pinned`:
    table -> the one sharding type the planner may give it (a peer benchmark plans what recforge's run chose)."""
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=world_size),
        kernel_config=KernelConfig(compute_device=device_type),
    )
    constraints = sharding_constraints(train, table_names)
    for table, kind in (pinned or {}).items():
        if table not in constraints:
            raise ValueError(f"pinned sharding: {table!r} is not a table of the model ({sorted(constraints)})")
        constraints[table] = ParameterConstraints(sharding_types=[kind], compute_kernels=[placement_kernel(kind)])
    return EmbeddingShardingPlanner(topology=topology, constraints=constraints, debug=False)


def placement_kernel(kind: str) -> str:
    """The compute kernel a placement gets: torchrec runs data_parallel only on the dense kernel, and the
    model-parallel kinds on the fused one (the dense kernel is refused there)."""
    return "dense" if kind == "data_parallel" else "fused"


def check_placements(placements: Mapping[str, Placement], table_dims: Mapping[str, int], world_size: int,
                     train: TrainConfig) -> None:
    """ValueError naming the table unless `placements` fit the model's tables (name -> embedding dim), the world
    and the kinds / kernels TrainConfig allows (the constraints the planner path gets)."""
    missing, extra = sorted(set(table_dims) - set(placements)), sorted(set(placements) - set(table_dims))
    if missing or extra:
        raise ValueError(f"placements: tables {missing} of the model have none, and {extra} are not tables of the "
                         f"model (its tables: {sorted(table_dims)})")
    constraints = sharding_constraints(train, list(table_dims))
    everyone = tuple(range(world_size))
    for table, p in placements.items():
        allowed = constraints[table]
        if p.kind not in allowed.sharding_types or placement_kernel(p.kind) not in allowed.compute_kernels:
            raise ValueError(
                f"placements: table {table!r} is {p.label()}, which needs the {placement_kernel(p.kind)} kernel; "
                f"train.sharding={train.sharding!r}, fused_embeddings={train.fused_embeddings} allow "
                f"{allowed.sharding_types} with kernels {allowed.compute_kernels}")
        bad = [r for r in p.ranks if not 0 <= r < world_size]
        if bad or not p.ranks:
            raise ValueError(f"placements: table {table!r} ({p.label()}) has ranks {bad or '[]'} outside "
                             f"0..{world_size - 1} (world_size {world_size})")
        if p.kind == "table_wise" and len(p.ranks) != 1:
            raise ValueError(f"placements: table {table!r}: table_wise takes one rank, got {list(p.ranks)}")
        if p.kind == "data_parallel" and tuple(p.ranks) != everyone:
            raise ValueError(f"placements: table {table!r}: data_parallel spans every rank {list(everyone)}, "
                             f"got {list(p.ranks)}")
        if p.kind == "column_wise":
            k, dim = len(p.ranks), table_dims[table]
            if len(set(p.ranks)) != k or dim % k or (dim // k) % 4:
                raise ValueError(f"placements: table {table!r}: column_wise over ranks {list(p.ranks)} needs distinct "
                                 f"ranks and {dim} columns split into {k} equal shards of a multiple of 4 columns")


def _check_same_on_every_rank(placements: Mapping[str, Placement], pg: dist.ProcessGroup) -> None:
    mine = sorted((t, p.kind, tuple(p.ranks)) for t, p in placements.items())
    everyone: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(everyone, mine, group=pg)
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        raise ValueError(f"placements: ranks {differ} passed placements that differ from rank 0's; every rank must "
                         "pass the same placements to shard_model")


def placement_plan(ebc: EmbeddingBagCollection, placements: Mapping[str, Placement], train: TrainConfig,
                   world_size: int, device_type: str, pg: dist.ProcessGroup | None = None) -> ShardingPlan:
    """The ShardingPlan (under EBC_PATH) that puts each table where `placements` says, checked (check_placements;
    with `pg`, also equal on every rank)."""
    if pg is not None:  # first: ranks that disagree all fail here, none waits in a later collective
        _check_same_on_every_rank(placements, pg)
    check_placements(placements, {c.name: c.embedding_dim for c in ebc.embedding_bag_configs()}, world_size, train)
    module_plan = to_torchrec(placements, ebc, world_size, device_type=device_type)
    for table, ps in module_plan.items():  # to_torchrec leaves torchrec's default kernel (dense) everywhere
        ps.compute_kernel = placement_kernel(placements[table].kind)
    return ShardingPlan({EBC_PATH: module_plan})


def to_torchrec(placements: Mapping[str, Placement], ebc: EmbeddingBagCollection, world_size: int,
                device_type: str = "cpu"):
    """An EmbeddingModuleShardingPlan for the EmbeddingBagCollection `ebc` (DMP takes it under the EBC's path)."""
    gen = {}
    for table, p in placements.items():
        if p.kind == "table_wise":
            gen[table] = table_wise(rank=p.ranks[0])
        elif p.kind == "column_wise":
            gen[table] = column_wise(ranks=list(p.ranks))
        else:
            gen[table] = data_parallel()
    return construct_module_sharding_plan(ebc, gen, local_size=world_size, world_size=world_size,
                                          device_type=device_type)
