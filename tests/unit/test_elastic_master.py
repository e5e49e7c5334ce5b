"""JobMaster over real HTTP with MasterClient."""
from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest

from master_token import TOKEN, master_with_token, token_env  # noqa: F401 (token_env: a fixture)
from recforge.elastic.agent.client import MasterClient, MasterUnavailableError
from recforge.elastic.master.service import JobMaster, shard_rows_from_manifest
from recforge.elastic.master.tasks import Action, TaskState

SHARDS = [23, 9, 16]
RPT = 4

pytestmark = pytest.mark.usefixtures("token_env")


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def rows_of(task):
    return [(task.epoch, task.shard, r) for r in range(task.row_start, task.row_end)]


def test_two_client_threads_consume_every_row_of_every_epoch_exactly_once(tmp_path):
    epochs = 2
    consumed: Counter = Counter()
    lock = threading.Lock()
    first_lease = threading.Barrier(2)
    errors = []

    def worker(url, wid):
        try:
            with MasterClient(url, wid, poll_interval_s=0.02) as c:
                first = True
                while not c.finished:
                    task = c.lease()  # None: end of this worker's epoch; then the next one
                    if first:
                        first_lease.wait(timeout=30)  # both threads hold a task at once
                        first = False
                    if task is None:
                        continue
                    with lock:
                        consumed.update(rows_of(task))
                    c.heartbeat(1)
                    assert c.done(task.task_id, task.rows)
        except BaseException as e:  # surfaced below
            errors.append(e)

    with master_with_token(SHARDS, rows_per_task=RPT, epochs=epochs, state_file=tmp_path / "state.json") as m:
        threads = [threading.Thread(target=worker, args=(m.url, f"w{i}")) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        state = MasterClient(m.url, "observer").epoch_state()
    expected = {(e, s, r) for e in range(epochs) for s, n in enumerate(SHARDS) for r in range(n)}
    assert set(consumed) == expected and set(consumed.values()) == {1}
    assert state["finished"] and state["epoch"] == epochs
    assert state["samples"] == sum(SHARDS) * epochs == state["rows_done_total"]
    assert set(state["workers"]) == {"w0", "w1"}
    assert all(w["tasks_done"] > 0 and w["step"] == 1 for w in state["workers"].values())
    assert state["tasks_done"] == sum(w["tasks_done"] for w in state["workers"].values())
    saved = json.loads((tmp_path / "state.json").read_text())
    assert saved["queue"]["epoch"] == epochs and set(saved["workers"]) == {"w0", "w1"}


def test_stale_done_is_rejected_and_heartbeat_renews_leases(tmp_path):
    clock = FakeClock()
    with master_with_token([8], rows_per_task=4, lease_timeout_s=10.0, clock=clock, expiry_interval_s=3600) as m:
        a, b = MasterClient(m.url, "a"), MasterClient(m.url, "b")
        t = a.lease()
        clock.t += 8
        assert a.heartbeat(3) == 1
        clock.t += 8  # 16 s after the lease, 8 after the heartbeat: still a's
        assert b.lease().task_id != t.task_id
        clock.t += 11  # a went silent: its lease expires on the next call
        assert b.lease() == t
        assert a.done(t.task_id, 4) is False
        assert b.done(t.task_id, 4) is True
        assert b.done(t.task_id, 4) is True  # a repeat is harmless ...
        state = m.state()
        assert state["workers"]["b"]["samples"] == 4  # ... and not counted twice
        assert state["workers"]["a"]["rejected"] == 1 and state["workers"]["a"]["step"] == 3


def test_periodic_expiry_without_calls():
    clock = FakeClock()
    with master_with_token([4], rows_per_task=4, lease_timeout_s=5.0, clock=clock, expiry_interval_s=0.05) as m:
        t = MasterClient(m.url, "a").lease()
        clock.t += 6
        for _ in range(400):  # bounded wait for the background check
            with m._lock:
                if m.queue.state_of(t.task_id) is TaskState.TODO:
                    break
            time.sleep(0.05)
        assert m.queue.state_of(t.task_id) is TaskState.TODO and m.queue.retries(t.task_id) == 1


def test_lease_retry_with_same_request_id_gets_same_answer():
    m = master_with_token([8], rows_per_task=4)  # in-process, no server needed
    g1 = m.lease("a", request_id="r1")
    assert m.lease("a", request_id="r1") == g1
    g2 = m.lease("a", request_id="r2")
    assert g2.task != g1.task and g2.action is Action.TASK


def test_release_over_http_returns_the_rest(tmp_path):
    with master_with_token([10], rows_per_task=10) as m:
        c = MasterClient(m.url, "a")
        t = c.lease()
        assert c.release(t.task_id, 6)
        rest = c.lease()
        assert (rest.row_start, rest.row_end) == (6, 10)
        assert c.done(rest.task_id, rest.rows)
        assert c.lease() is None and c.finished
        assert m.state()["samples"] == 10


def test_restarted_master_resumes_from_its_state_file(tmp_path, monkeypatch):
    state_file = tmp_path / "master" / "state.json"
    kw = dict(rows_per_task=RPT, epochs=2, state_file=state_file)
    seen: Counter = Counter()
    m1 = master_with_token(SHARDS, **kw).start()
    port = m1.port
    c = MasterClient(m1.url, "a", max_attempts=40, backoff_s=0.05, max_backoff_s=0.2)
    for _ in range(5):
        t = c.lease()
        seen.update(rows_of(t))
        assert c.done(t.task_id, t.rows)
    held = c.lease()  # in flight across the restart
    m1.stop()
    with pytest.raises(ValueError, match="rows_per_task"):
        master_with_token(SHARDS, rows_per_task=RPT + 1, epochs=2, state_file=state_file)

    # a client call during the outage is retried until the new master answers on the same port
    m2 = master_with_token(SHARDS, port=port, **kw)
    assert m2.restored and m2.queue.holder(held.task_id) == "a"
    import recforge.elastic.agent.client as client_mod

    retrying = threading.Event()
    real_sleep = time.sleep

    def sleep(s):  # the caller's backoff sleep: it failed to reach the master at least once
        if threading.current_thread().name == "caller":
            retrying.set()
        real_sleep(s)

    monkeypatch.setattr(client_mod.time, "sleep", sleep)
    result = {}
    caller = threading.Thread(target=lambda: result.update(ok=c.done(held.task_id, held.rows)), name="caller")
    caller.start()
    assert retrying.wait(timeout=30)
    m2.start()
    caller.join(timeout=30)
    assert result == {"ok": True}
    seen.update(rows_of(held))
    while True:
        t = c.lease()
        if t is None:
            if c.finished:
                break
            continue
        seen.update(rows_of(t))
        assert c.done(t.task_id, t.rows)
    state = m2.state()
    m2.stop()
    expected = {(e, s, r) for e in range(2) for s, n in enumerate(SHARDS) for r in range(n)}
    assert set(seen) == expected and set(seen.values()) == {1}
    assert state["workers"]["a"]["samples"] == sum(SHARDS) * 2  # stats survived the restart


def test_new_launch_and_new_generation_take_back_leases(tmp_path):
    state_file = tmp_path / "state.json"
    with master_with_token([4, 4, 4], rows_per_task=4, state_file=state_file, lease_timeout_s=1000) as m:
        old = MasterClient(m.url, "r0-g0", generation=0).lease()
        new = MasterClient(m.url, "r0-g1", generation=1)
        got = new.lease()
        assert got == old  # the older generation's lease came back at once, first in order
        with pytest.raises(ValueError, match="409.*generation 0 is stale"):  # the replaced group is locked out
            MasterClient(m.url, "r1-g0", generation=0).lease()
        other = MasterClient(m.url, "r1-g1", generation=1).lease()
    assert m.queue.retries(old.task_id) == 1
    m2 = master_with_token([4, 4, 4], rows_per_task=4, state_file=state_file, new_launch=True)
    assert m2.queue.state_of(got.task_id) is TaskState.TODO and m2.queue.state_of(other.task_id) is TaskState.TODO
    assert m2.queue.generation == 0


def test_client_gives_up_after_bounded_retries():
    from recforge.elastic.backends.local import free_port

    c = MasterClient(f"http://127.0.0.1:{free_port()}", "a", max_attempts=3, backoff_s=0.01)
    with pytest.raises(MasterUnavailableError, match="3 times"):
        c.lease()


def test_bad_request_is_an_error_not_a_retry():
    with master_with_token([4], rows_per_task=4) as m:
        c = MasterClient(m.url, "a")
        with pytest.raises(ValueError, match="422"):
            c.done("x", -1)


def test_shard_rows_from_manifest(tmp_path):
    shards = [{"path": "p0", "rows": 5}, {"path": "p1", "rows": 7}]
    (tmp_path / "manifest.json").write_text(json.dumps({"shards": shards}))
    assert shard_rows_from_manifest(tmp_path) == [5, 7]
    m = JobMaster.from_manifest(tmp_path, rows_per_task=4, token=TOKEN)
    assert len(m.queue.tasks()) == 4
    with pytest.raises(FileNotFoundError):
        shard_rows_from_manifest(tmp_path / "nope")
