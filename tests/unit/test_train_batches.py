"""TaskBatches: every leased row is trained exactly once, padded with zero weights, and a task is
reported done (with its real row count) only after its last batch was trained."""
from __future__ import annotations

import pytest
import torch

from recforge.config import DatasetConfig, DenseFeature, SparseFeature
from recforge.data.generator import generate_days
from recforge.data.ingest import ingest
from recforge.data.shards import read_rows
from recforge.elastic.master.tasks import Task
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import TorchExecutor
from recforge.preprocess.planning.plan import criteo_plan
from recforge.train.loop.batches import TaskBatches, empty

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


@pytest.fixture(scope="module")
def manifest_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    generate_days(DS, root / "raw", days=1, rows_per_day=230, seed=1)
    ingest([root / "raw" / "day_0.tsv"], DS, root / "data", rows_per_shard=130, max_bad_fraction=0.0)
    return root / "data"


def _task(i, shard, a, b):
    return Task(task_id=f"t{i}", epoch=0, shard=shard, row_start=a, row_end=b)


def test_rows_padding_and_done_reports(manifest_dir):
    tasks = [_task(0, 0, 0, 50), _task(1, 0, 50, 50), _task(2, 1, 30, 100), _task(3, 0, 120, 130)]
    client = FakeClient(tasks)
    ex = TorchExecutor(criteo_plan(DS, table_cap=16), DS)
    src = TaskBatches(client, manifest_dir, DS, ex, batch_size=32, device=torch.device("cpu"))
    seen_labels, batches = [], 0
    while (b := src.next()) is not None:
        batches += 1
        assert b.dense.shape == (32, 1) and b.labels.shape == (32,) and b.weights.shape == (32,)
        assert b.sparse.keys() == ["C1", "C2"] and b.sparse.stride() == 32
        assert b.weights.sum().item() == b.real and (b.weights[: b.real] == 1).all()
        # done is reported only after the task's last batch was trained
        assert not any(e[0] == "done" and e[1] == b.task_id for e in client.events)
        seen_labels.append(b.labels[: b.real])
        src.trained(b)
        if b.last_of_task:
            assert client.events[-1] == ("done", b.task_id, {"t0": 50, "t2": 70, "t3": 10}[b.task_id])
    # t0: 50 rows -> 2 batches, t1 empty (done at once), t2: 70 rows -> 3 batches, t3: 10 rows -> 1 batch
    assert batches == 6
    assert src.next() is None  # stays exhausted without asking the master again
    assert [e for e in client.events if e[0] == "done"] == [
        ("done", "t0", 50), ("done", "t1", 0), ("done", "t2", 70), ("done", "t3", 10)]
    assert src.tasks_done == 3
    expected = torch.cat([
        RawBatch.from_arrow(read_rows(manifest_dir, s, a, e), DS).label
        for s, a, e in [(0, 0, 50), (1, 30, 100), (0, 120, 130)]
    ])
    torch.testing.assert_close(torch.cat(seen_labels), expected)


def test_empty_batch_has_zero_weight():
    ex = TorchExecutor(criteo_plan(DS, table_cap=16), DS)
    b = empty(DS, 8, ex, torch.device("cpu"))
    assert b.real == 0 and b.weights.sum().item() == 0 and b.dense.shape == (8, 1)
    assert b.sparse.stride() == 8 and b.sparse.values().numel() == 16
