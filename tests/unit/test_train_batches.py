"""TaskBatches: every leased row is trained exactly once, padded with zero weights, and a task is
reported done (with its real row count) only after its last batch was trained."""
from __future__ import annotations

import pytest
import torch

from recforge.data.shards import read_rows
from recforge.preprocess.batch import RawBatch
from recforge.preprocess.executor import TorchExecutor
from recforge.preprocess.planning.plan import criteo_plan
from recforge.train.loop.batches import TaskBatches, empty, prepare
from task_source_fixtures import DS, FakeClient, task, tiny_shards


@pytest.fixture(scope="module")
def manifest_dir(tmp_path_factory):
    return tiny_shards(tmp_path_factory.mktemp("batches"))


def test_rows_padding_and_done_reports(manifest_dir):
    tasks = [task(0, 0, 0, 50), task(1, 0, 50, 50), task(2, 1, 30, 100), task(3, 0, 120, 130)]
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


def test_full_batch_is_not_copied_and_equals_the_padded_path(manifest_dir):
    """A batch of exactly batch_size rows skips the pad copy; its features equal what the padding path gives the
    same rows, its weights are all 1, and its KJT already has per-key lengths / offsets (synced off the step)."""
    ex = TorchExecutor(criteo_plan(DS, table_cap=16), DS)
    raw = RawBatch.from_arrow(read_rows(manifest_dir, 0, 0, 32), DS)
    full = prepare(raw, 32, ex, torch.device("cpu"))
    padded, weights = raw.pad_to(33)
    dense, kjt = ex(padded)
    assert full.real == 32 and full.weights.dtype == torch.float32 and bool((full.weights == 1).all())
    torch.testing.assert_close(full.dense, dense[:32])
    torch.testing.assert_close(full.labels, raw.label)
    assert full.labels.data_ptr() == raw.label.data_ptr()  # no copy of the task's rows
    assert full.sparse._length_per_key is not None and full.sparse._offset_per_key is not None
    for key in ("C1", "C2"):
        torch.testing.assert_close(full.sparse[key].values(), kjt[key].values()[: full.sparse[key].values().numel()])
    with pytest.raises(ValueError, match="cannot pad 32 rows down to 16"):
        prepare(raw, 16, ex, torch.device("cpu"))
