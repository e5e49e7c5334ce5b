"""PrefetchBatches: steps built ahead on a thread hand out every row once, in order; a task is reported done only after
its rows were trained; progress() never counts rows read ahead; a failing read surfaces in the trainer; and the step
loop over it trains exactly what the synchronous loop trains, on 2 ranks whose data runs out at different steps."""
from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from recforge.preprocess.executor import TorchExecutor
from recforge.preprocess.planning.plan import criteo_plan
from recforge.train.loop.batches import TaskBatches
from recforge.train.loop.prefetch import PrefetchBatches
from task_source_fixtures import DS, FakeClient, task, tiny_shards

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def manifest_dir(tmp_path_factory):
    return tiny_shards(tmp_path_factory.mktemp("prefetch"))


def _source(manifest_dir, tasks, batch=32):
    client = FakeClient(tasks)
    ex = TorchExecutor(criteo_plan(DS, table_cap=16), DS)
    return client, TaskBatches(client, manifest_dir, DS, ex, batch_size=batch, device=CPU)


def test_rows_once_done_after_trained_and_progress_excludes_read_ahead(manifest_dir):
    tasks = [task(0, 0, 0, 50), task(1, 0, 50, 50), task(2, 1, 30, 100), task(3, 0, 120, 130)]
    client, inner = _source(manifest_dir, tasks)
    _, reference = _source(manifest_dir, tasks)
    src = PrefetchBatches(inner, depth=3)
    rows = []
    while (step := src.next_step()) is not None:
        (b,) = step.micro
        assert step.g_has == 1 and step.g_real == b.real  # world size 1: the counts are the local ones
        ref = reference.next()
        torch.testing.assert_close(b.labels, ref.labels)
        # the batch's rows are handed out but not trained: the task is not done, progress counts them
        src.flush()
        assert not any(e[0] == "done" and e[1] == b.task_id for e in client.events)
        assert src.progress() == {b.task_id: b.row_end - tasks[int(b.task_id[1:])].row_start}
        rows.append((b.task_id, b.row_start, b.row_end))
        src.trained(b)
        src.flush()
        if b.last_of_task:
            assert ("done", b.task_id, b.task_rows) in client.events
            assert b.task_id not in src.progress()
    assert reference.next() is None
    src.close()
    assert rows == [("t0", 0, 32), ("t0", 32, 50), ("t2", 30, 62), ("t2", 62, 94), ("t2", 94, 100),
                    ("t3", 120, 130)]
    # the empty t1 is done when leased (read ahead: before t0's last batch was trained); the others in order
    assert [e for e in client.events if e[0] == "done" and e[1] != "t1"] == [
        ("done", "t0", 50), ("done", "t2", 70), ("done", "t3", 10)]
    assert ("done", "t1", 0) in client.events
    assert src.tasks_done == 3 and src.next_step() is None


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_idle_priority_applies_to_the_reading_thread_only(manifest_dir):
    tasks = [task(0, 0, 0, 50)]
    seen: list[int] = []

    class Recording(TaskBatches):
        def next(self):
            seen.append(os.sched_getscheduler(0))  # pid 0: the calling thread
            return super().next()

    client = FakeClient(tasks)
    inner = Recording(client, manifest_dir, DS, TorchExecutor(criteo_plan(DS, table_cap=16), DS), batch_size=32,
                      device=CPU)
    src = PrefetchBatches(inner, depth=2, idle_priority=True)
    got = 0
    while (step := src.next_step()) is not None:
        got += step.real
        src.trained(step.micro[0])
    src.close()
    assert got == 50 and seen and set(seen) == {os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the trainer's thread keeps its policy


def test_accumulation_steps_and_read_failure(manifest_dir):
    client, inner = _source(manifest_dir, [task(0, 0, 0, 70)], batch=32)
    src = PrefetchBatches(inner, accumulation=2, depth=2)
    first, second = src.next_step(), src.next_step()
    assert [b.real for b in first.micro] == [32, 32] and first.g_real == 64
    assert second.micro[0].real == 6 and second.micro[1] is None and second.g_real == 6
    assert src.next_step() is None
    for b in (*first.micro, second.micro[0]):
        src.trained(b)
    src.close()
    assert ("done", "t0", 70) in client.events

    class Broken(TaskBatches):
        def read_task(self, task):
            raise OSError(f"shard {task.shard} unreadable")

    bad = PrefetchBatches(Broken(FakeClient([task(0, 1, 0, 10)]), manifest_dir, DS,
                                 TorchExecutor(criteo_plan(DS, table_cap=16), DS), batch_size=8, device=CPU))
    with pytest.raises(RuntimeError, match="preparing step 1 failed.*shard 1 unreadable"):
        bad.next_step()
    with pytest.raises(RuntimeError, match="reading thread failed"):
        bad.close()


def test_refuses_bad_arguments(manifest_dir):
    _, inner = _source(manifest_dir, [])
    with pytest.raises(ValueError, match="must be >= 1"):
        PrefetchBatches(inner, depth=0)
    with pytest.raises(ValueError, match="counts_per_reduce"):
        PrefetchBatches(inner, counts_per_reduce=0)
    with pytest.raises(ValueError, match="process group"):
        PrefetchBatches(inner, world_size=2)


# ---- 2 ranks: the step's global counts come from the side group; the epoch ends on the same step everywhere ------
# Two ranks as threads of this process, each with its own gloo groups (no spawn): a "world" group the trainer thread
# uses every step, as the model's collectives do, and the side group PrefetchBatches all-reduces the counts on.
RANK_TASKS = {0: [(0, 0, 0, 40), (1, 0, 40, 100), (2, 1, 0, 30)], 1: [(3, 1, 30, 60)]}  # rank 1 runs dry first


def _groups(name: str) -> dict[int, dist.ProcessGroup]:
    store, groups = dist.HashStore(), {}

    def make(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return groups


@pytest.mark.parametrize("counts_per_reduce,depth", [(1, 2), (2, 2), (4, 3), (9, 1)])
def test_two_ranks_share_counts_and_end_together(manifest_dir, counts_per_reduce, depth):
    """Whatever number of steps one side all_reduce counts (9 steps: the epoch's end inside the first group; 4 of
    depth 3: the end inside the third), every rank gets the same steps and counts, and they end on the same one."""
    world, side = _groups(f"world{counts_per_reduce}"), _groups(f"side{counts_per_reduce}")
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def rank_loop(rank):
        try:
            client = FakeClient([task(*t) for t in RANK_TASKS[rank]])
            ex = TorchExecutor(criteo_plan(DS, table_cap=16), DS)
            src = PrefetchBatches(TaskBatches(client, manifest_dir, DS, ex, batch_size=16, device=CPU), depth=depth,
                                  group=side[rank], world_size=2, timeout_s=60, counts_per_reduce=counts_per_reduce)
            steps = []
            while (step := src.next_step()) is not None:
                dist.all_reduce(torch.zeros(1), group=world[rank])  # the trainer's own collective, beside the thread's
                steps.append((step.g_has, step.g_real, step.real))
                for b in step.micro:
                    if b is not None:
                        src.trained(b)
            src.close()
            results[rank] = {"steps": steps, "done": [e for e in client.events if e[0] == "done"]}
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    r0, r1 = results[0], results[1]
    # rank 0: 40 + 60 + 30 rows in batches of 16 = 3 + 4 + 2 steps; rank 1: 30 rows = 2 steps, then empty ones
    assert len(r0["steps"]) == len(r1["steps"]) == 9
    assert [s[:2] for s in r0["steps"]] == [s[:2] for s in r1["steps"]]  # the same global counts on both ranks
    assert [g for g, _, _ in r0["steps"]] == [2, 2] + [1] * 7
    assert [g_real for _, g_real, _ in r0["steps"]] == [
        a + b for (_, _, a), (_, _, b) in zip(r0["steps"], r1["steps"], strict=True)]
    assert sum(s[2] for s in r0["steps"]) == 130 and sum(s[2] for s in r1["steps"]) == 30
    assert r0["done"] == [("done", "t0", 40), ("done", "t1", 60), ("done", "t2", 30)]
    assert r1["done"] == [("done", "t3", 30)]
