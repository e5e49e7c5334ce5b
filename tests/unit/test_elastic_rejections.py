"""Bad input to the job master over HTTP: rejected with an error that names it, and nothing changes."""
from __future__ import annotations

import json

import pytest

from master_token import TOKEN, master_with_token, token_env  # noqa: F401 (token_env: a fixture)
from recforge.elastic.agent.client import MasterClient
from recforge.elastic.master.service import JobMaster, ScaleRejectedError
from recforge.elastic.master.tasks import TaskState

pytestmark = pytest.mark.usefixtures("token_env")


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def frozen(m: JobMaster) -> str:
    """The master's whole state except last-seen times (a refused call may still be logged as seen)."""
    with m._lock:
        return json.dumps({"queue": m.queue.to_dict(), "scale": m.pending_scale,
                           "workers": {w: {k: v for k, v in vars(s).items() if k != "last_seen"}
                                       for w, s in m.workers.items()}}, sort_keys=True)


@pytest.fixture
def master():
    clock = FakeClock()
    with master_with_token([8, 8], rows_per_task=4, lease_timeout_s=10.0, clock=clock, expiry_interval_s=3600,
                   max_workers=4) as m:
        m.clock = clock
        yield m


def test_unknown_worker_ids_are_refused(master):
    a = MasterClient(master.url, "a")
    t = a.lease()
    before = frozen(master)
    ghost = MasterClient(master.url, "ghost")
    for call in (lambda: ghost.done(t.task_id, 4), lambda: ghost.release(t.task_id, 1), lambda: ghost.heartbeat(3),
                 lambda: ghost.snapshot({}), lambda: ghost.command()):
        with pytest.raises(ValueError, match=r"404.*unknown worker id 'ghost'"):
            call()
    assert frozen(master) == before
    assert a.done(t.task_id, 4)


def test_duplicate_and_stale_done_are_not_double_counted(master):
    a, b = MasterClient(master.url, "a"), MasterClient(master.url, "b")
    t = a.lease()
    assert a.done(t.task_id, 4)
    before = frozen(master)
    assert a.done(t.task_id, 4)  # a retried report: accepted as a duplicate, counted once
    assert frozen(master) == before
    b.lease()
    assert not b.done(t.task_id, 4)  # someone else's task: stale
    assert not a.done("e0-s9-r0", 4)  # no such task
    s = master.state()
    assert s["workers"]["a"]["samples"] == 4 and s["workers"]["a"]["tasks_done"] == 1
    assert s["workers"]["b"]["samples"] == 0 and s["workers"]["b"]["rejected"] == 1
    assert s["rows_done_this_epoch"] == 4


def test_lease_renewed_after_expiry_is_refused_and_reported_lost(master):
    a, b = MasterClient(master.url, "a"), MasterClient(master.url, "b")
    t = a.lease()
    assert a.heartbeat_leases(1, [t.task_id]) == []
    master.clock.t += 11  # a's lease expires
    assert a.heartbeat_leases(2, [t.task_id]) == [t.task_id]  # not renewed: lost
    assert master.queue.state_of(t.task_id) is TaskState.TODO and master.queue.retries(t.task_id) == 1
    got = b.lease()
    assert got == t
    assert a.heartbeat_leases(3, [t.task_id]) == [t.task_id]
    assert not a.done(t.task_id, 4) and b.done(t.task_id, 4)
    assert master.state()["rows_done_this_epoch"] == 4


def test_calls_from_a_replaced_generation_are_refused(master):
    old = MasterClient(master.url, "r0-old", generation=0)
    t = old.lease()
    new = MasterClient(master.url, "r0-new", generation=1)
    new.join()
    before = frozen(master)
    for call in (old.lease, lambda: old.done(t.task_id, 4), lambda: old.heartbeat(1),
                 lambda: old.restore(None, "zombie")):
        with pytest.raises(ValueError, match=r"409.*generation 0 is stale.*generation 1"):
            call()
    assert frozen(master) == before
    assert master.queue.state_of(t.task_id) is TaskState.TODO  # taken back when generation 1 joined


@pytest.mark.parametrize("workers, match", [(0, "below the minimum of 1"), (-3, "below the minimum of 1"),
                                            (5, "above this job's limit of max_workers=4")])
def test_scale_outside_the_limits_is_refused(master, workers, match):
    c = MasterClient(master.url, "a")
    before = frozen(master)
    with pytest.raises(ValueError, match=f"422.*{match}"):
        c.request_scale(workers, "test")
    with pytest.raises(ScaleRejectedError, match=match):
        master.request_scale(workers)
    assert frozen(master) == before and master.pending_scale is None


def test_scale_request_within_limits_becomes_a_stop_command(master):
    c = MasterClient(master.url, "a")
    c.lease()
    assert c.command() == {"command": "continue", "reason": ""}
    assert c.request_scale(1, "shrink")["workers"] == 1
    assert c.command()["command"] == "stop"
    assert master.take_scale()["workers"] == 1 and master.pending_scale is None
    assert c.command()["command"] == "continue"


def test_restore_rejects_a_state_of_another_job_and_bad_snapshots(master):
    c = MasterClient(master.url, "a")
    t = c.lease()
    other = master_with_token([5], rows_per_task=4).queue.to_dict()
    before = frozen(master)
    with pytest.raises(ValueError, match=r"400.*shard_rows=\[5\] does not match"):
        c.restore(other, "wrong job")
    with pytest.raises(ValueError, match=r"400.*not in flight"):
        c.snapshot({"e0-s1-r0": 2})
    with pytest.raises(ValueError, match=r"400.*outside \[0, 4\]"):
        c.snapshot({t.task_id: 9})
    assert frozen(master) == before


def test_restore_rolls_back_and_locks_out_the_old_group(master):
    a = MasterClient(master.url, "a", generation=0)
    t1 = a.lease()
    assert a.done(t1.task_id, 4)
    t2 = a.lease()
    snap = a.snapshot({t2.task_id: 2})  # a checkpoint: t1 done, 2 rows of t2
    t3 = a.lease()
    assert a.done(t2.task_id, 4) and a.done(t3.task_id, 4)  # trained after the checkpoint, then a dies
    new = MasterClient(master.url, "a2", generation=1)
    out = new.restore(snap, "test")
    assert out["rows_done_this_epoch"] == 6 and out["rows_redone"] == 12 - 6
    assert master.queue.generation == 1
    with pytest.raises(ValueError, match="409"):
        a.lease()
    seen = []
    while (t := new.lease()) is not None:
        seen.append((t.shard, t.row_start, t.row_end))
        assert new.done(t.task_id, t.rows)
    assert sorted(seen)[0] == (t2.shard, t2.row_start + 2, t2.row_end)
    assert sum(e - s for _, s, e in seen) == 16 - 6
    assert new.finished
