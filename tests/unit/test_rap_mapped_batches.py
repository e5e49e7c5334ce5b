"""MappedTaskBatches (recforge.rap.mapping.mapped_batches) through the real train_epoch on 2 gloo ranks.

The same tasks are trained twice from the same weights: with RAP's mapping (each rank preprocesses the global
batch of the table it holds, no input all-to-all) and without it (each rank preprocesses every feature of its
local rows; torchrec's input all-to-all). Per-step losses and final weights must be equal; every row is trained
exactly once; only rank 0 talks to the master.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from recforge.config import DatasetConfig, DenseFeature, SparseFeature
from recforge.elastic.master.tasks import Task
from recforge.train.distributed import free_port

DS = DatasetConfig(
    name="tiny",
    dense=[DenseFeature(name="I1", missing_rate=0.3), DenseFeature(name="I2")],
    sparse=[SparseFeature(name="C1", cardinality=40, missing_rate=0.2), SparseFeature(name="C2", cardinality=9),
            SparseFeature(name="C3", cardinality=25)],
)
WORLD, B = 2, 16
PLACEMENTS = {"C1": ("table_wise", (1,)), "C2": ("data_parallel", (0, 1)), "C3": ("column_wise", (0, 1))}
TASKS = [(0, 0, 50), (0, 50, 50), (0, 50, 130), (1, 0, 100)]  # (shard, rows) - one empty task


class Client:
    """One rank's client of the job's task queue, shared through a file (the master's role): lease pops the next
    task, under a lock; `events` is what this rank asked."""

    def __init__(self, queue: Path):
        self.queue, self.events = queue, []

    def lease(self):
        import fcntl
        import json

        with open(self.queue, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            tasks = json.loads(f.read())
            task = Task(**tasks.pop(0)) if tasks else None
            f.seek(0), f.truncate(), f.write(json.dumps(tasks))
        self.events.append(("lease", task.task_id if task else None))
        return task

    def done(self, task_id, samples):
        self.events.append(("done", task_id, samples))
        return True


class Ledger:
    def __init__(self):
        self.rows = []

    def record(self, epoch, shard, a, b):
        self.rows.append((shard, a, b))


@pytest.fixture(scope="module")
def manifest_dir(tmp_path_factory):
    from recforge.data.generator import generate_days
    from recforge.data.ingest import ingest

    root = tmp_path_factory.mktemp("mapped")
    generate_days(DS, root / "raw", days=1, rows_per_day=230, seed=3)
    ingest([root / "raw" / "day_0.tsv"], DS, root / "data", rows_per_shard=130, max_bad_fraction=0.0)
    return root / "data"


def _plan():
    from recforge.preprocess.planning.plan import criteo_plan

    return criteo_plan(DS, table_cap=32)


def _sharded(plan):
    from recforge.config import ModelConfig, TrainConfig
    from recforge.rap.mapping.milp import Placement
    from recforge.train.model import build_dlrm
    from recforge.train.sharding import shard_model

    torch.manual_seed(0)
    model = build_dlrm(ModelConfig(arch="dlrm", embedding_dim=8, dense_arch=[8, 8], over_arch=[8, 1]),
                       plan.tables(), len(plan.dense_features()))
    placements = {t: Placement(k, r) for t, (k, r) in PLACEMENTS.items()}
    return shard_model(model, TrainConfig(embedding_lr=0.1, dense_lr=0.05), world_size=WORLD,
                       device=torch.device("cpu"), dense_optimizer="sgd", placements=placements)


def _worker(rank, port, manifest_dir, out_dir):
    import torch.distributed as dist

    from recforge.preprocess.executor import make_executor
    from recforge.rap.mapping.mapped_batches import MappedTaskBatches
    from recforge.rap.mapping.mapped_input import MappedInput
    from recforge.rap.mapping.milp import from_torchrec, split_rank_plan
    from recforge.rap.runtime.session import CorunSession
    from recforge.train.loop.batches import Batch, empty
    from recforge.train.loop.step_loop import LoopState, train_epoch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cpu = torch.device("cpu")
    try:
        plan = _plan()
        full = make_executor("fused", plan, DS)

        class Unmapped(MappedTaskBatches):  # same rows per rank and step, every feature local, input all-to-all
            def prepare_mapped(self, raw):
                dense, kjt = full(raw.local)
                return Batch(dense=dense, sparse=kjt, labels=raw.local.label, weights=raw.weights, real=raw.real)

        out = {}
        for mode in ("unmapped", "mapped", "mapped_corun"):
            sharded = _sharded(plan)
            queue = Path(out_dir) / f"queue-{mode}.json"
            if rank == 0:
                queue.write_text(json.dumps([dict(task_id=f"t{i}", epoch=0, shard=s, row_start=a, row_end=z)
                                             for i, (s, a, z) in enumerate(TASKS)]))
            dist.barrier()
            client, ledger, losses = Client(queue), Ledger(), []
            session = None
            if mode == "mapped_corun":
                mapped = MappedInput.install(sharded.model, rank, WORLD)
                session = CorunSession(plan, DS, None, sharded.model, cpu, threads=1, jobs=_jobs(plan, rank),
                                       mapped=mapped, sharding=sharded.plan_summary())
                source = session.batches(client, manifest_dir, DS, B, cpu, ledger)
            elif mode == "mapped":
                mapped = MappedInput.install(sharded.model, rank, WORLD)
                local_plan, global_plan = split_rank_plan(plan, from_torchrec(sharded.plan_summary()), rank)
                source = MappedTaskBatches(client, manifest_dir, DS, make_executor("fused", local_plan, DS),
                                           make_executor("fused", global_plan, DS) if global_plan else None,
                                           B, cpu, rank, WORLD, ledger=ledger)
            else:
                source = Unmapped(client, manifest_dir, DS, full, None, B, cpu, rank, WORLD, ledger=ledger)
            stats = train_epoch(sharded, source, empty(DS, B, full, cpu), LoopState(), epoch=0, world_size=WORLD,
                                log_every=1, rank=rank,
                                sink=lambda m, step, losses=losses: losses.append(m["train_loss"]))
            if session is not None:
                session.close()
                out["corun_summary"] = session.summary()
            sebc = MappedInput(_ebc(sharded.model), rank, WORLD).sebc
            out[mode] = {"losses": losses, "events": client.events, "rows": ledger.rows, "samples": stats.samples,
                         "state": {k: _local(v) for k, v in sharded.model.state_dict().items()},
                         "input_dist_built": not sebc._has_uninitialized_input_dist,
                         "plans": [p.name for p in split_rank_plan(plan, from_torchrec(sharded.plan_summary()), rank)
                                   if p]}
        torch.save(out, Path(out_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def _jobs(plan, rank):
    """Each rank's two co-run jobs: kernels priced by their rows so that they spread over (and split across) the
    stages, the global job at twice the local rows."""
    from recforge.preprocess.executors.fused import FusedExecutor
    from recforge.rap.mapping.milp import Placement
    from recforge.rap.planning.scheduler import mapped_rank_schedules
    from recforge.rap.profiling.stages import STAGES

    placements = {t: Placement(k, r) for t, (k, r) in PLACEMENTS.items()}
    stage_ms = {s: 1.0 for s in STAGES}
    capacity = {s: 0.3 for s in STAGES}
    planned = mapped_rank_schedules(plan, placements, rank, WORLD, B, stage_ms, capacity,
                                    lambda compiled, rows: (lambda g: 0.01 * len(g.nodes) * rows))
    return [(FusedExecutor(c.plan, DS, compiled=c), sched) for c, sched in planned]


def _ebc(model):
    from recforge.rap.mapping.mapped_input import _sharded_ebc

    return _sharded_ebc(model)


def _local(t):
    if hasattr(t, "local_shards"):
        return torch.cat([torch.empty(0)] + [s.tensor.reshape(-1) for s in t.local_shards()]).clone()
    return t.detach().clone()


def test_mapped_training_equals_input_all_to_all(tmp_path, manifest_dir):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(free_port(), str(manifest_dir), str(tmp_path)), nprocs=WORLD)
    outs = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    base = outs[0]["unmapped"]
    assert len(base["losses"]) == 2 + 3 + 4  # global batches of 32 rows: ceil(50/32) + ceil(80/32) + ceil(100/32)
    for mode in ("mapped", "mapped_corun"):
        mapped = outs[0][mode]
        torch.testing.assert_close(torch.tensor(mapped["losses"]), torch.tensor(base["losses"]), rtol=0, atol=1e-6)
        assert mapped["samples"] == base["samples"] == 230
        for out in outs:
            m, u = out[mode], out["unmapped"]
            for k, v in u["state"].items():
                torch.testing.assert_close(m["state"][k], v, rtol=0, atol=1e-6, msg=k)
            assert m["input_dist_built"] is False and u["input_dist_built"] is True
        # every row trained exactly once, split between the ranks
        covered = {s: [] for s in (0, 1)}
        for s, a, z in (r for out in outs for r in out[mode]["rows"]):
            covered[s].extend(range(a, z))
        assert sorted(covered[0]) == list(range(130)) and sorted(covered[1]) == list(range(100))
        assert all(out[mode]["rows"] for out in outs)
        # the ranks take turns leasing (task k: rank k mod 2, the end of the queue: rank 0) and each reports its
        # tasks done (the empty one at once); the other rank never touches a task it did not lease
        events = [out[mode]["events"] for out in outs]
        assert [e for e in events[0] if e[0] == "lease"] == [("lease", "t0"), ("lease", "t2"), ("lease", None)]
        assert [e for e in events[1] if e[0] == "lease"] == [("lease", "t1"), ("lease", "t3")]
        done = [sorted(e for e in ev if e[0] == "done") for ev in events]
        assert done == [[("done", "t0", 50), ("done", "t2", 80)], [("done", "t1", 0), ("done", "t3", 100)]]
    for out in outs:  # the co-run really ran inside the steps, both jobs
        summary = out["corun_summary"]
        assert summary["batches"] == 9 and summary["stages_opened_by_step"] > 0
        assert set(summary["mapped"]["schedules"]) == {"global", "local"}
        assert summary["steps"] >= 8
    assert outs[0]["mapped"]["plans"] == [f"{_plan().name}@rank0.local", f"{_plan().name}@rank0.global"]
    assert outs[1]["mapped"]["plans"] == [f"{_plan().name}@rank1.local", f"{_plan().name}@rank1.global"]


class FailingClient:
    def lease(self):
        raise ConnectionError("master unreachable")

    def done(self, task_id, samples):
        raise AssertionError("no task was leased")


def _lease_failure_worker(rank, port, manifest_dir, out_dir):
    import torch.distributed as dist

    from recforge.preprocess.executor import make_executor
    from recforge.rap.mapping.mapped_batches import MappedTaskBatches

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        ex = make_executor("fused", _plan(), DS)
        source = MappedTaskBatches(FailingClient(), manifest_dir, DS, ex, None, B, torch.device("cpu"), rank, WORLD)
        try:
            source.next()
            outcome = "no error"
        except Exception as e:  # rank 0 (the leaser) re-raises the client's error, rank 1 gets its message
            outcome = f"{type(e).__name__}: {e}"
        (Path(out_dir) / f"lease-{rank}.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()


def test_a_failed_lease_fails_every_rank(tmp_path, manifest_dir):
    """The leaser's error reaches the ranks waiting for its broadcast (they would otherwise hang)."""
    import torch.multiprocessing as mp

    mp.spawn(_lease_failure_worker, args=(free_port(), str(manifest_dir), str(tmp_path)), nprocs=WORLD)
    assert (tmp_path / "lease-0.txt").read_text() == "ConnectionError: master unreachable"
    assert (tmp_path / "lease-1.txt").read_text() == \
        "RuntimeError: rank 0 could not lease a task: ConnectionError: master unreachable"
