"""TaskQueue.snapshot / restore: the data state a checkpoint carries, against a row-level reference."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from recforge.elastic.master.tasks import TaskQueue, TaskState

SHARDS = [23, 9, 16]


def rows(task, upto=None):
    end = task.row_end if upto is None else task.row_start + upto
    return [(task.epoch, task.shard, r) for r in range(task.row_start, end)]


def drain(q: TaskQueue, worker="w") -> Counter:
    """Consume everything the queue still hands out (all epochs), done task by task."""
    got: Counter = Counter()
    while not q.finished:
        t = q.lease(worker, 0.0)
        if t is None:
            raise AssertionError(f"nothing to lease but not finished: {q.summary()}")
        got.update(rows(t))
        assert q.done(t.task_id, worker).ok
    return got


def test_snapshot_cuts_in_flight_tasks_and_leaves_the_live_queue_alone():
    q = TaskQueue(SHARDS, rows_per_task=5)
    a, b, c = q.lease("r0", 0.0), q.lease("r1", 0.0), q.lease("r2", 0.0)
    assert q.done(a.task_id, "r0").ok
    before = q.to_dict()
    snap = TaskQueue.from_dict(q.snapshot({b.task_id: 3}))  # r1 trained 3 rows of b; c not at all
    assert q.to_dict() == before
    assert snap.state_of(a.task_id) is TaskState.DONE
    assert snap.state_of(b.task_id) is TaskState.DONE
    cut = [t for t in snap.tasks() if t.task_id == b.task_id][0]
    assert (cut.row_start, cut.row_end) == (b.row_start, b.row_start + 3)
    rest = [t for t in snap.tasks(TaskState.TODO) if t.shard == b.shard and t.row_start == b.row_start + 3]
    assert rest and rest[0].row_end == b.row_end
    assert snap.state_of(c.task_id) is TaskState.TODO and snap.retries(c.task_id) == 0  # not a failure
    assert snap.in_flight == 0
    assert snap.summary()["rows_done_this_epoch"] == a.rows + 3


def test_snapshot_then_restore_hands_out_exactly_the_untrained_rows():
    """Random interleavings: rows trained before the snapshot + rows handed out after restoring it =
    every row of every epoch exactly once."""
    for seed in range(40):
        rng = random.Random(seed)
        q = TaskQueue(SHARDS, rows_per_task=rng.choice([3, 4, 7]), epochs=2, shuffle_seed=seed)
        trained: Counter = Counter()
        held: dict[str, tuple] = {}
        for _ in range(rng.randrange(1, 25)):
            if q.finished:
                break
            w = f"r{rng.randrange(3)}"
            if w in held and rng.random() < 0.6:
                t, _ = held.pop(w)
                trained.update(rows(t))
                assert q.done(t.task_id, w).ok
            elif w not in held:
                t = q.lease(w, 0.0)
                if t is not None:
                    held[w] = (t, rng.randrange(0, t.rows + 1))  # rows of it trained so far
        progress = {}
        for t, n in held.values():
            progress[t.task_id] = n
            trained.update(rows(t, n))
        restored = TaskQueue.from_dict(q.snapshot(progress))
        trained.update(drain(restored))
        expected = {(e, s, r) for e in range(2) for s, n in enumerate(SHARDS) for r in range(n)}
        assert set(trained) == expected and set(trained.values()) == {1}, seed


def test_snapshot_of_a_finished_cut_advances_the_epoch():
    q = TaskQueue([4], rows_per_task=4, epochs=2)
    t = q.lease("r0", 0.0)
    snap = TaskQueue.from_dict(q.snapshot({t.task_id: 4}))
    assert snap.epoch == 1 and snap.history[0]["rows_done"] == 4


def test_snapshot_rejects_progress_on_tasks_not_in_flight():
    q = TaskQueue([8], rows_per_task=4)
    t = q.lease("r0", 0.0)
    with pytest.raises(ValueError, match="not in flight"):
        q.snapshot({"e0-s0-r4": 1})
    with pytest.raises(ValueError, match="outside"):
        q.snapshot({t.task_id: 5})
    assert q.done(t.task_id, "r0").ok
    with pytest.raises(ValueError, match="not in flight"):
        q.snapshot({t.task_id: 2})
