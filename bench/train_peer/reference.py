"""The peer: TorchRec's reference training loop (as torchrec_dlrm/dlrm_main.py in facebookresearch/dlrm drives it),
re-implemented here: rows preprocessed in memory with its standard transform (dense log(x + 3) of the filled counts,
sparse id modulo the table size), DMP over the same DLRM and sharding planner, the embeddings' optimizer applied in
backward, `TrainPipelineSparseDist` over in-memory torchrec Batches; held-out AUC with the sharded model.

`run(args)` spawns `world` ranks (gloo, `threads` intra-op threads each) and returns rank 0's report.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recforge.config import ModelConfig, TrainConfig
from recforge.preprocess.batch import RawBatch
from recforge.train.metrics import auc, logloss
from recforge.train.model import build_dlrm
from recforge.train.sharding import make_planner, plan_summary


@dataclass
class Rows:
    """Rows preprocessed with the reference's transform, in memory."""

    dense: torch.Tensor  # float32[N, Fd]
    ids: torch.Tensor  # int64[N, Fs], in [0, table rows)
    labels: torch.Tensor  # float32[N]


def transform(raw: RawBatch, table_rows: list[int]) -> Rows:
    """torchrec's Criteo preprocessing: missing -> 0, dense log(x + 3) (counts below -2 clipped to -2), sparse id
    modulo its table's rows."""
    dense = torch.log(raw.dense.to(torch.float64).clamp(min=-2.0) + 3.0).to(torch.float32)
    ids = torch.remainder(raw.sparse, torch.tensor(table_rows, dtype=torch.int64))
    return Rows(dense=dense.contiguous(), ids=ids.contiguous(), labels=raw.label.to(torch.float32))


def to_batches(rows: Rows, keys: list[str], batch: int, rank: int, world: int) -> list[Batch]:
    """This rank's batches of `batch` rows: global step s takes rows [s*world*batch + rank*batch, ... + batch); the
    last partial global step is dropped (as the reference's drop_last)."""
    out = []
    step_rows = batch * world
    for s in range(rows.labels.shape[0] // step_rows):
        a = s * step_rows + rank * batch
        ids = rows.ids[a:a + batch]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=ids.t().reshape(-1).contiguous(),
            lengths=torch.ones(len(keys) * batch, dtype=torch.int32))
        out.append(Batch(dense_features=rows.dense[a:a + batch], sparse_features=kjt, labels=rows.labels[a:a + batch]))
    return out


class TrainModule(torch.nn.Module):
    """The DLRM with its loss, as the pipeline calls it: batch -> (loss, (loss, logits, labels)) (DLRMTrain's
    contract)."""

    def __init__(self, dlrm: torch.nn.Module) -> None:
        super().__init__()
        self.model = dlrm
        self.loss_fn = torch.nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = self.loss_fn(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def torchrec_dlrm(model_cfg: ModelConfig, tables: list[tuple[str, int]], num_dense: int) -> torch.nn.Module:
    """The reference's model: torchrec's DLRM modules as they ship (recforge's trainer swaps in its fused interaction
    and sparse arch, train.fused_interaction; the same configuration and initial weights)."""
    return build_dlrm(model_cfg, tables, num_dense, "cpu", fused=False)


def build(model_cfg: ModelConfig, train: TrainConfig, tables: list[tuple[str, int]], num_dense: int, world: int,
          seed: int, pinned: dict[str, str] | None = None,
          ) -> tuple[DistributedModelParallel, CombinedOptimizer, dict[str, Any]]:
    """DMP over TrainModule(DLRM): the planner under recforge's constraints (the same plan), RowWiseAdagrad in
    backward for the fused tables, Adam for the dense parameters, recforge's learning rates."""
    torch.manual_seed(seed)
    dlrm = torchrec_dlrm(model_cfg, tables, num_dense)
    module = TrainModule(dlrm)
    init = {k: v.detach().clone() for k, v in module.state_dict().items()}
    sharders = [EmbeddingBagCollectionSharder()]
    ebc = dlrm.sparse_arch.embedding_bag_collection
    planner = make_planner(train, [c.name for c in ebc.embedding_bag_configs()], world, "cpu", pinned=pinned)
    # planned on the bare DLRM, as recforge's shard_model does, then keyed by the wrapper's module path
    plan = planner.collective_plan(dlrm, sharders, dist.GroupMember.WORLD)
    mod_plan = plan.plan["sparse_arch.embedding_bag_collection"]
    plan.plan = {"model.sparse_arch.embedding_bag_collection": mod_plan}
    for table, ps in mod_plan.items():
        if ps.compute_kernel == "fused":
            apply_optimizer_in_backward(RowWiseAdagrad, [ebc.embedding_bags[table].weight],
                                        {"lr": train.embedding_lr, "eps": 1e-8})
    dmp = DistributedModelParallel(module, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dmp.load_state_dict(init)
    rest = dict(in_backward_optimizer_filter(dmp.named_parameters(), include=False))
    emb = {k: p for k, p in rest.items() if ".embedding_bag_collection." in k}
    dense = {k: p for k, p in rest.items() if k not in emb}
    opts = [dmp.fused_optimizer] if dmp.fused_optimizer.params else []
    if emb:  # data_parallel tables (dense kernel): the same optimizer, stepped after DDP's all_reduce
        opts.append(KeyedOptimizerWrapper(emb, lambda ps: torch.optim.Adagrad(ps, lr=train.embedding_lr, eps=1e-8)))
    opts.append(KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=train.dense_lr)))
    summary = plan_summary(type(plan)({"sparse_arch.embedding_bag_collection": mod_plan}))
    return dmp, CombinedOptimizer(opts), summary


def _phases(dmp: DistributedModelParallel, opt: CombinedOptimizer, batches: list[Batch]) -> dict[str, float]:
    """Seconds per phase over `batches` without pipelining (timers; CPU ops are synchronous): data (taking the next
    in-memory batch), forward (input all-to-all, lookup, output all-to-all, MLPs, loss), backward (embedding
    gradients' all-to-all, the fused update, DDP's all_reduce), optimizer (dense step); wall and the loop thread's
    CPU seconds (`<phase>_cpu_s`, as recforge's PhaseTimes)."""
    names = ("data", "forward", "backward", "optimizer")
    wall, cpu = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    marks = [(time.perf_counter(), time.thread_time())]

    def mark(phase: str) -> None:
        now = (time.perf_counter(), time.thread_time())
        wall[phase] += now[0] - marks[-1][0]
        cpu[phase] += now[1] - marks[-1][1]
        marks[-1] = now

    it = iter(batches)
    for _ in range(len(batches)):
        b = next(it)
        mark("data")
        loss, _ = dmp(b)
        mark("forward")
        loss.backward()
        mark("backward")
        opt.step()
        opt.zero_grad()
        mark("optimizer")
    return {"steps": float(len(batches)), **{f"{k}_s": v for k, v in wall.items()},
            **{f"{k}_cpu_s": v for k, v in cpu.items()}}


def _rank(rank: int, world: int, port: int, cfg: dict[str, Any], out_dir: str) -> None:
    # the variables torchrun sets for recforge's workers
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", ROLE_RANK=str(rank),
                      ROLE_WORLD_SIZE=str(world))
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        data = torch.load(cfg["data_path"], weights_only=False)
        train_rows, eval_rows = data["train"], data["eval"]
        keys, tables = data["keys"], data["tables"]
        model_cfg, train = ModelConfig.model_validate(cfg["model"]), TrainConfig.model_validate(cfg["train"])
        batches = to_batches(train_rows, keys, train.batch_size, rank, world)
        dmp, opt, summary = build(model_cfg, train, tables, data["num_dense"], world, cfg["seed"], cfg.get("pinned"))
        dmp.train()
        pipeline = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"), execute_all_batches=True)
        dist.barrier()
        t0 = time.perf_counter()
        it = iter(batches)
        steps = 0
        while True:
            try:
                pipeline.progress(it)
            except StopIteration:
                break
            steps += 1
        dist.barrier()
        wall = time.perf_counter() - t0
        # held-out AUC (the trained model), then the phase profile on a fresh model (training state untouched)
        model = pipeline.detach()  # the model's own forward back (the pipeline rewrote the sharded module's)
        model.eval()
        labels, logits = [], []
        eval_batch = max(1, min(cfg["eval_batch"], eval_rows.labels.shape[0] // world))
        with torch.no_grad():
            for b in to_batches(eval_rows, keys, eval_batch, rank, world):
                _, (_, z, y) = model(b)
                labels.append(y.numpy())
                logits.append(z.numpy())
        local = (np.concatenate(labels), np.concatenate(logits))
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, local)
        prof_n = min(cfg["profile_steps"], len(batches))
        pdmp, popt, _ = build(model_cfg, train, tables, data["num_dense"], world, cfg["seed"], cfg.get("pinned"))
        pdmp.train()
        phases = _phases(pdmp, popt, batches[:prof_n])
        all_phases: list[Any] = [None] * world
        dist.all_gather_object(all_phases, phases)
        if rank == 0:
            y = np.concatenate([p[0] for p in parts])
            z = np.concatenate([p[1] for p in parts])
            rows = steps * train.batch_size * world
            # the same loop without the pipeline, from the phase profile (slowest rank: the ranks step in lockstep)
            unpiped = max(sum(v for k, v in p.items() if k.endswith("_s") and not k.endswith("_cpu_s"))
                          for p in all_phases)
            report = {"samples": rows, "steps": steps, "train_wall_s": wall, "samples_per_s": rows / wall,
                      "unpipelined_samples_per_s": prof_n * train.batch_size * world / max(unpiped, 1e-9),
                      "heldout_auc": auc(y, z), "heldout_logloss": logloss(y, z), "heldout_rows": int(y.size),
                      "sharding_plan": summary, "phases": all_phases}
            torch.save(report, Path(out_dir) / "reference.pt")
    finally:
        dist.destroy_process_group()


def run(data_path: Path, *, model: ModelConfig, train: TrainConfig, world: int, threads: int, seed: int,
        eval_batch: int = 5000, profile_steps: int = 30, pinned: dict[str, str] | None = None,
        env: dict[str, str] | None = None) -> dict[str, Any]:
    """Train the reference over the rows in `data_path` (see `save_rows`) on `world` spawned ranks; rank 0's report.
    `pinned`: table -> sharding type, the plan recforge's run chose (the planner breaks ties differently per run).
    `env`: variables set for the spawned ranks (besides OMP_NUM_THREADS)."""
    import socket  # lazy: only to pick a free port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = {"data_path": str(data_path), "model": model.model_dump(mode="json"), "train": train.model_dump(mode="json"),
           "threads": threads, "seed": seed, "eval_batch": eval_batch, "profile_steps": profile_steps,
           "pinned": pinned}
    with tempfile.TemporaryDirectory(prefix="recforge_ref_") as out:
        env = {**(env or {}), "OMP_NUM_THREADS": str(threads)}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            mp.start_processes(_rank, args=(world, port, cfg, out), nprocs=world, join=True, start_method="spawn")
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return torch.load(Path(out) / "reference.pt", weights_only=False)


def save_rows(path: Path, train: Rows, eval_rows: Rows, keys: list[str], tables: list[tuple[str, int]],
              num_dense: int) -> Path:
    """The reference's in-memory inputs, written once for the spawned ranks (temp + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"train": train, "eval": eval_rows, "keys": keys, "tables": tables, "num_dense": num_dense}, tmp)
    os.replace(tmp, path)
    return path
