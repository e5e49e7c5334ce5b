"""TaskQueue: dynamic data sharding logic (no I/O)."""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from recforge.elastic.master.tasks import Action, Outcome, TaskQueue, TaskState

SHARDS = [37, 0, 16, 5, 64]
RPT = 8  # rows per task


def all_rows(shard_rows, epochs):
    return {(e, s, r) for e in range(epochs) for s, n in enumerate(shard_rows) for r in range(n)}


def rows_of(task, upto=None):
    end = task.row_end if upto is None else task.row_start + upto
    return [(task.epoch, task.shard, r) for r in range(task.row_start, end)]


def test_tasks_cover_each_shard_in_order_without_spanning_shards():
    q = TaskQueue(SHARDS, RPT, epochs=1)
    tasks = q.tasks()
    assert [(t.shard, t.row_start) for t in tasks] == sorted((t.shard, t.row_start) for t in tasks)
    assert all(0 < t.rows <= RPT for t in tasks)
    covered = Counter(row for t in tasks for row in rows_of(t))
    assert set(covered) == all_rows(SHARDS, 1) and set(covered.values()) == {1}
    # hand-out order is the (shard, row) order
    leased = [q.lease("w", 0.0) for _ in tasks]
    assert leased == tasks and q.lease("w", 0.0) is None


def test_shuffle_seed_is_a_deterministic_permutation_per_epoch():
    def order(seed, epoch_steps):
        q = TaskQueue(SHARDS, RPT, epochs=2, shuffle_seed=seed)
        out = []
        for _ in range(epoch_steps):
            t = q.lease("w", 0.0)
            out.append((t.epoch, t.shard, t.row_start))
            q.done(t.task_id, "w")
        return out

    n = len(TaskQueue(SHARDS, RPT).tasks())
    a, b = order(7, 2 * n), order(7, 2 * n)
    assert a == b
    e0 = [x[1:] for x in a[:n]]
    e1 = [x[1:] for x in a[n:]]
    assert sorted(e0) == sorted(e1) and e0 != sorted(e0) and e0 != e1
    assert order(8, n) != a[:n]


def test_every_row_of_every_epoch_leased_and_done_exactly_once_with_several_workers():
    epochs = 3
    q = TaskQueue(SHARDS, RPT, epochs=epochs)
    rng = random.Random(0)
    workers = {f"w{i}": None for i in range(4)}
    consumed = Counter()
    now = 0.0
    while not q.finished:
        now += 1.0
        w = rng.choice(sorted(workers))
        task = workers[w]
        if task is None:
            workers[w] = q.lease(w, now)
            continue
        consumed.update(rows_of(task))
        assert q.done(task.task_id, w) is Outcome.ACCEPTED
        assert q.done(task.task_id, w) is Outcome.DUPLICATE  # idempotent
        workers[w] = None
    assert set(consumed) == all_rows(SHARDS, epochs) and set(consumed.values()) == {1}
    assert [h["rows_done"] for h in q.history] == [sum(SHARDS)] * epochs
    assert q.summary()["rows_done_total"] == sum(SHARDS) * epochs


def test_releases_expiries_and_stale_workers_lose_no_row():
    """Workers consume a task a few rows per tick. Some die mid-task (their lease expires), some stall
    past their deadline and report too late (rejected), some stop early and release the rest. Every
    row is consumed at least once; rows outside failed attempts exactly once; the queue credits every
    row exactly once."""
    epochs, timeout = 2, 6.0
    q = TaskQueue(SHARDS, RPT, epochs=epochs, lease_timeout_s=timeout, max_retries=1000)
    rng = random.Random(1)
    consumed, credited, failed_rows = Counter(), Counter(), set()
    workers = {f"w{i}": {"task": None, "pos": 0, "sleep_until": 0.0} for i in range(3)}
    gen = Counter()
    now, events = 0.0, Counter()
    while not q.finished:
        now += 1.0
        q.expire(now)
        wid = rng.choice(sorted(workers))
        w = workers[wid]
        if now < w["sleep_until"]:
            continue
        name = f"{wid}.{gen[wid]}"
        task = w["task"]
        if task is None:
            w["task"], w["pos"] = q.lease(name, now), 0
            continue
        q.renew(name, now)
        chunk = min(3, task.rows - w["pos"])
        consumed.update(rows_of(task)[w["pos"]: w["pos"] + chunk])
        attempt = rows_of(task)[: w["pos"] + chunk]
        w["pos"] += chunk
        roll = rng.random()
        if roll < 0.08:  # dies holding the lease: restarts under a new name
            failed_rows.update(attempt)
            gen[wid] += 1
            w["task"] = None
            events["died"] += 1
        elif roll < 0.14 and w["pos"] < task.rows:  # stops early, gives the rest back
            assert q.release(task.task_id, name, w["pos"]) is Outcome.ACCEPTED
            credited.update(attempt)
            w["task"] = None
            events["released"] += 1
        elif roll < 0.2:  # stalls past its deadline, then goes on as if nothing happened
            w["sleep_until"] = now + 2 * timeout
            events["stalled"] += 1
        elif w["pos"] == task.rows:
            out = q.done(task.task_id, name)
            if out is Outcome.ACCEPTED:
                credited.update(attempt)
            else:
                assert out is Outcome.STALE
                failed_rows.update(attempt)
                events["rejected"] += 1
            w["task"] = None
    assert min(events[k] for k in ("died", "released", "stalled", "rejected")) > 0, events
    everything = all_rows(SHARDS, epochs)
    assert set(consumed) == everything
    assert all(consumed[r] == 1 for r in everything - failed_rows)
    assert set(credited) == everything and set(credited.values()) == {1}
    assert not q.poisoned


def test_poison_after_three_expiries_is_reported_and_never_handed_out_again():
    q = TaskQueue([8, 8], 8, epochs=2, lease_timeout_s=10.0, max_retries=3)
    bad = q.lease("a", 0.0)
    now = 0.0
    for attempt in range(1, 4):
        now += 11.0
        out = q.expire(now)
        if attempt < 3:
            assert out.requeued == [bad] and q.retries(bad.task_id) == attempt
            assert q.state_of(bad.task_id) is TaskState.TODO
            assert q.lease(f"w{attempt}", now) == bad  # first in order again
        else:
            assert out.poisoned == [bad] and not out.requeued
    assert q.state_of(bad.task_id) is TaskState.POISON
    assert q.poisoned == [bad] and q.summary()["poisoned"] == [bad.model_dump()]
    good = q.lease("b", now)
    assert good.shard == 1 and q.lease("c", now) is None
    assert q.done(bad.task_id, "w2") is Outcome.STALE
    q.done(good.task_id, "b")
    assert q.epoch == 1  # the poisoned task does not block the epoch
    assert q.history[0] == {"epoch": 0, "tasks_done": 1, "rows_done": 8, "tasks_poisoned": 1}
    assert len(q.tasks(TaskState.TODO)) == 2  # epoch 1 gets the shard again


def test_done_and_release_rules():
    q = TaskQueue([10], 10, epochs=1, lease_timeout_s=5.0)
    t = q.lease("a", 0.0)
    assert q.done(t.task_id, "b") is Outcome.STALE
    assert q.done("nope", "a") is Outcome.UNKNOWN
    q.expire(6.0)  # a's lease expired; the task is TODO, not re-leased yet
    assert q.done(t.task_id, "a") is Outcome.STALE
    t2 = q.lease("b", 6.0)
    assert t2 == t and q.holder(t.task_id) == "b"
    assert q.release(t.task_id, "a", 4) is Outcome.STALE
    assert q.release(t.task_id, "b", 4) is Outcome.ACCEPTED
    assert q.release(t.task_id, "b", 4) is Outcome.DUPLICATE
    done_part, rest = q.tasks()
    assert (done_part.row_start, done_part.row_end, rest.row_start, rest.row_end) == (0, 4, 4, 10)
    assert q.state_of(rest.task_id) is TaskState.TODO and q.retries(rest.task_id) == 1  # inherits retries
    r = q.lease("c", 7.0)
    assert r == rest
    assert q.release(r.task_id, "c", 0) is Outcome.ACCEPTED  # nothing consumed: plain give-back
    assert q.release(r.task_id, "c", 0) is Outcome.DUPLICATE
    assert q.retries(r.task_id) == 1  # a release is not a failure
    r = q.lease("c", 8.0)
    assert q.release(r.task_id, "c", 99) is Outcome.ACCEPTED  # consumed it all: done
    assert q.finished and q.summary()["rows_done_total"] == 10
    with pytest.raises(ValueError):
        q.release(r.task_id, "c", -1)


def test_renew_keeps_a_lease_alive():
    q = TaskQueue([4], 4, lease_timeout_s=5.0)
    t = q.lease("a", 0.0)
    assert q.renew("a", 4.0) == 1 and q.renew("b", 4.0) == 0
    assert not q.expire(8.0)
    assert q.expire(9.5).requeued == [t]


def test_request_grants_task_end_epoch_wait_finished():
    q = TaskQueue([4, 4], 4, epochs=2)
    g = q.request("a", 0.0)
    assert g.action is Action.TASK and g.epoch == 0
    b = q.request("b", 0.0, epoch=0).task
    # nothing TODO in epoch 0, b's task in flight: a ends its epoch
    assert q.request("a", 0.0, epoch=0).action is Action.END_EPOCH
    q.done(g.task.task_id, "a")
    # a is ahead (epoch 1) while epoch 0 still waits for b
    assert q.request("a", 0.0, epoch=1).action is Action.WAIT
    # b dies; its task comes back and goes to a, who is already in epoch 1
    q.recover("b")
    leftover = q.request("a", 0.0, epoch=1)
    assert leftover.action is Action.TASK and leftover.task == b and leftover.epoch == 0
    q.done(b.task_id, "a")
    assert q.epoch == 1
    assert q.request("c", 0.0, epoch=0).action is Action.END_EPOCH  # a lagging worker's epoch is over
    for _ in range(2):
        t = q.request("a", 0.0, epoch=1).task
        q.done(t.task_id, "a")
    g = q.request("a", 0.0, epoch=1)
    assert g.action is Action.FINISHED and q.finished and g.epoch == 2


def test_new_generation_takes_back_older_leases_at_once():
    q = TaskQueue([4, 4, 4], 4, lease_timeout_s=1000.0)
    old = [q.lease("r0", 0.0, generation=0), q.lease("r1", 0.0, generation=0)]
    assert not q.observe_generation(0)
    out = q.observe_generation(1)
    assert sorted(t.task_id for t in out.requeued) == sorted(t.task_id for t in old)
    assert q.generation == 1 and all(q.retries(t.task_id) == 1 for t in old)
    q.lease("r0", 0.0, generation=1)
    assert not q.observe_generation(1)
    assert q.new_launch().requeued and q.generation == 0


def test_empty_and_invalid_inputs():
    q = TaskQueue([0, 0], 4, epochs=3)
    assert q.finished and q.lease("a", 0.0) is None
    assert q.request("a", 0.0).action is Action.FINISHED
    for bad in (dict(shard_rows=[-1], rows_per_task=4), dict(shard_rows=[4], rows_per_task=0)):
        with pytest.raises(ValueError):
            TaskQueue(**bad)
    with pytest.raises(ValueError, match="epochs"):
        TaskQueue([4], 4, epochs=0)


def test_persistence_round_trip_continues_identically():
    q = TaskQueue(SHARDS, RPT, epochs=2, lease_timeout_s=5.0, shuffle_seed=3)
    a = q.lease("a", 0.0)
    b = q.lease("b", 0.0)
    c = q.lease("c", 1.0)
    q.done(a.task_id, "a")
    q.release(b.task_id, "b", 3)
    q.expire(5.5)  # a lease from t=0 would be gone; c (t=1) stays
    assert q.holder(c.task_id) == "c"
    q.lease("d", 2.0)
    d = json.loads(json.dumps(q.to_dict()))
    r = TaskQueue.from_dict(d)
    assert r.to_dict() == q.to_dict()
    # both continue the same way
    for qq in (q, r):
        qq.expire(7.5)
    seq = []
    for qq in (q, r):
        s = []
        while not qq.finished:
            t = qq.lease("z", 10.0)
            if t is None:
                break
            s.append(t)
            qq.done(t.task_id, "z")
        seq.append(s)
    assert seq[0] == seq[1] and q.finished and r.finished
    assert q.summary() == r.summary()
    with pytest.raises(ValueError, match="version"):
        TaskQueue.from_dict({**d, "version": 99})
