"""What the batch-source tests share (test_train_batches, test_train_prefetch): a tiny dataset, its shards, a job
master client that leases a fixed task list and records every call, and a task constructor."""
from __future__ import annotations

from pathlib import Path

from recforge.config import DatasetConfig, DenseFeature, SparseFeature
from recforge.data.generator import generate_days
from recforge.data.ingest import ingest
from recforge.elastic.master.tasks import Task

DS = DatasetConfig(
    name="tiny",
    dense=[DenseFeature(name="I1", missing_rate=0.3)],
    sparse=[SparseFeature(name="C1", cardinality=40, missing_rate=0.2), SparseFeature(name="C2", cardinality=9)],
)


class FakeClient:
    def __init__(self, tasks):
        self.tasks = list(tasks)
        self.events: list[tuple] = []

    def lease(self):
        task = self.tasks.pop(0) if self.tasks else None
        self.events.append(("lease", task.task_id if task else None))
        return task

    def done(self, task_id, samples):
        self.events.append(("done", task_id, samples))
        return True


def tiny_shards(root: Path) -> Path:
    """230 generated rows of DS ingested into shards of 130 rows (two shards) under root / 'data'."""
    generate_days(DS, root / "raw", days=1, rows_per_day=230, seed=1)
    ingest([root / "raw" / "day_0.tsv"], DS, root / "data", rows_per_shard=130, max_bad_fraction=0.0)
    return root / "data"


def task(i, shard, a, b) -> Task:
    return Task(task_id=f"t{i}", epoch=0, shard=shard, row_start=a, row_end=b)
