"""The job master's incremental persistence (snapshot + append-only log): what a crashed master left on disk is
what it had in memory; compaction; a torn last line; a restart from the log."""
from __future__ import annotations

import json
import logging
import random
import time

import pytest

from recforge.elastic.master.service import JobMaster
from recforge.elastic.master.state_log import StateLog, read_master_state, remove_master_state
from recforge.elastic.master.tasks import TaskQueue, TaskState

SHARDS = [37, 0, 16, 5, 64]
RPT = 8
TOKEN = "state-log-test-" + "k" * 32


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def new_master(path, clock, **kw) -> JobMaster:
    return JobMaster(SHARDS, rows_per_task=RPT, epochs=3, state_file=path, lease_timeout_s=10.0, max_retries=4,
                     shuffle_seed=5, clock=clock, token=TOKEN, max_workers=8, **kw)


def in_memory(m: JobMaster) -> dict:
    """The master's state as `read_master_state` reports it, from memory. Heartbeat-only telemetry (a worker's
    step and last-seen time) and renewed deadlines are not logged, so they are left out on both sides."""
    with m._lock:
        doc = {"version": 1, "queue": m.queue.to_dict(), "workers": {w: dict(vars(s)) for w, s in m.workers.items()},
               "last_lease": {w: [rid, g.model_dump(mode="json")] for w, (rid, g) in m._last_lease.items()},
               "pending_scale": m.pending_scale}
    return comparable(doc)


def comparable(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    doc.pop("log_from", None)
    for st in doc["workers"].values():
        st.pop("step"), st.pop("last_seen")
    doc["queue"]["records"] = sorted(doc["queue"]["records"], key=lambda r: r["task"]["task_id"])
    for r in doc["queue"]["records"]:
        if r["state"] == "doing":
            r["deadline"] = None
    return doc


def drive(m: JobMaster, clock: FakeClock, rng: random.Random, steps: int, compact_every: int = 0) -> None:
    """Random traffic in process: leases, dones, releases, expiries, a new generation, scale requests, a restore
    to a snapshot; heartbeats in between (not logged)."""
    held: dict[str, list] = {}
    gen = m.queue.generation
    snap = None
    for i in range(steps):
        if m.queue.finished:
            return
        clock.t += rng.choice([0.5, 1.0, 3.0])
        w = f"w{rng.randrange(4)}-g{gen}"
        roll = rng.random()
        tasks = held.setdefault(w, [])
        if roll < 0.35 or not tasks:
            g = m.lease(w, None, gen, request_id=f"r{i}")
            if g.task is not None:
                tasks.append(g.task)
        elif roll < 0.65:
            t = tasks.pop(0)
            m.done(w, t.task_id, t.rows, gen)
        elif roll < 0.72:
            t = tasks.pop(0)
            m.release(w, t.task_id, rng.randrange(t.rows), gen)
        elif roll < 0.85:
            m.heartbeat_leases(w, i, gen, [t.task_id for t in tasks])
        elif roll < 0.88:
            clock.t += 11.0  # every lease not renewed meanwhile expires on the next call
        elif roll < 0.9 and snap is None:
            inflight = {t.task_id: min(2, t.rows) for t in tasks if m.queue.holder(t.task_id) == w}
            snap = m.snapshot(w, gen, inflight)
        elif roll < 0.92 and snap is not None:
            gen += 1
            held.clear()
            m.restore(f"w0-g{gen}", gen, snap, "test")
            snap = None
        elif roll < 0.94:
            m.request_scale(rng.randrange(1, 9), "test")
        elif roll < 0.95:
            m.take_scale()
        else:
            m.command(w, gen)
        if compact_every and i % compact_every == 0:
            compact(m)


def compact(m: JobMaster) -> None:
    """One compaction, waited for (it writes the snapshot in a forked child)."""
    m._compact()
    assert m._compactor_done(wait_s=30)


def test_a_crashed_master_left_exactly_its_memory_on_disk(tmp_path):
    clock, rng = FakeClock(), random.Random(7)
    path = tmp_path / "master_state.json"
    m = new_master(path, clock)
    for rounds in range(6):  # crash points: after compactions, mid-epoch, after a restore, ...
        drive(m, clock, rng, 60, compact_every=25 if rounds % 2 else 0)
        assert comparable(read_master_state(path)) == in_memory(m)  # no stop(): what a SIGKILL would leave
    assert m.queue.epoch >= 1 and m.queue.history  # epochs advanced in between (replayed, not logged)
    # a new master on the crashed one's files continues where it was; its leases get a fresh deadline
    expect = in_memory(m)
    m2 = new_master(path, clock)
    assert m2.restored
    assert in_memory(m2) == expect
    assert all(r.deadline == clock.t + 10.0 for r in m2.queue._doing.values())
    drive(m2, clock, rng, 40)
    m2.stop()  # a clean stop folds the log into the snapshot
    assert len(StateLog(path).segments()) == 1 and StateLog(path).segments()[0][1].stat().st_size == 0
    assert comparable(json.loads(path.read_text())) == in_memory(m2)


def test_heartbeats_are_not_logged_and_calls_write_one_append_each(tmp_path):
    clock = FakeClock()
    m = new_master(tmp_path / "s.json", clock)
    seg = StateLog(m.state_file).segment_path(m._log.segment)
    g = m.lease("a", None, 0, request_id="x")
    size = seg.stat().st_size
    lines = seg.read_text().splitlines()
    assert [[kind for kind, _ in json.loads(x)] for x in lines] == [["rec", "lease", "worker"]]  # one line
    for step in range(50):
        clock.t += 1
        m.heartbeat_leases("a", step, 0, [g.task.task_id])
    assert seg.stat().st_size == size
    assert m.done("a", g.task.task_id, g.task.rows, 0).ok
    assert seg.stat().st_size > size


def test_compaction_folds_the_log_into_the_snapshot(tmp_path):
    clock, rng = FakeClock(), random.Random(3)
    path = tmp_path / "master_state.json"
    m = new_master(path, clock)
    drive(m, clock, rng, 80)
    segs_before = StateLog(path).segments()
    assert sum(len(p.read_text().splitlines()) for _, p in segs_before) > 50
    compact(m)
    snap = json.loads(path.read_text())
    segs = StateLog(path).segments()
    assert [n for n, _ in segs] == [snap["log_from"]] and segs[0][1].stat().st_size == 0  # older ones deleted
    assert comparable(snap) == in_memory(m)  # the snapshot alone is the whole state
    with m._lock:
        assert TaskQueue.from_dict(snap["queue"]).summary() == m.queue.summary()
    drive(m, clock, rng, 30)
    assert comparable(read_master_state(path)) == in_memory(m)  # snapshot + the new segment
    compact(m)
    compact(m)  # nothing changed: no new snapshot, no new segment
    assert len(StateLog(path).segments()) == 1


def test_the_master_compacts_by_itself_while_it_serves(tmp_path):
    path = tmp_path / "master_state.json"
    with new_master(path, FakeClock(), snapshot_interval_s=0.05) as m:
        g = m.lease("a", None, 0)
        for _ in range(400):  # bounded wait for the periodic snapshot
            if json.loads(path.read_text())["log_from"] > 1:
                break
            time.sleep(0.02)
        snap = json.loads(path.read_text())
        assert any(r["state"] == "doing" and r["task"]["task_id"] == g.task.task_id for r in snap["queue"]["records"])
        assert len(StateLog(path).segments()) == 1


def test_a_torn_last_line_is_dropped_and_said(tmp_path, caplog):
    clock = FakeClock()
    path = tmp_path / "master_state.json"
    m = new_master(path, clock)
    t1 = m.lease("a", None, 0).task
    expect = in_memory(m)
    seg = StateLog(path).segment_path(m._log.segment)
    size = seg.stat().st_size
    t2 = m.lease("a", None, 0).task
    data = seg.read_bytes()
    seg.write_bytes(data[: size + 40])  # the crash: the second lease's first line half written
    with caplog.at_level(logging.WARNING):
        saved = StateLog(path).load()
        assert saved.torn and "incomplete last line" in saved.torn
        assert comparable(saved.to_dict()) == expect
        m2 = new_master(path, clock)
    assert any("incomplete last line" in r.getMessage() for r in caplog.records)
    assert m2.queue.state_of(t2.task_id) is TaskState.TODO and m2.queue.holder(t1.task_id) == "a"
    m2.lease("b", None, 0)
    m3 = new_master(path, clock)  # the torn segment was folded into m2's snapshot: no error now
    assert m3.queue.holder(t1.task_id) == "a"


def test_a_bad_line_before_the_end_is_an_error_naming_it(tmp_path):
    clock = FakeClock()
    path = tmp_path / "master_state.json"
    m = new_master(path, clock)
    m.lease("a", None, 0)
    m.lease("b", None, 0)
    seg = StateLog(path).segment_path(m._log.segment)
    lines = seg.read_text().splitlines()
    lines[1] = "{garbage"
    seg.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"{seg.name}:2: unreadable log line"):
        read_master_state(path)
    remove_master_state(path)
    assert not list(tmp_path.iterdir())
    with pytest.raises(FileNotFoundError, match="job master state not found"):
        read_master_state(path)


def test_change_tracking_replays_to_the_same_queue():
    """TaskQueue level: the tracked changes of random traffic, replayed on the starting state, give the same queue
    (deadlines aside: renewals are not changes)."""
    rng = random.Random(11)
    q = TaskQueue(SHARDS, RPT, epochs=3, lease_timeout_s=5.0, max_retries=2, shuffle_seed=1)
    start = q.to_dict()
    q.track_changes()
    replica = TaskQueue.from_dict(start)
    now, held = 0.0, {}
    while not q.finished:
        now += 1.0
        w = f"w{rng.randrange(3)}"
        roll = rng.random()
        if roll < 0.1:
            q.expire(now + 6.0)  # every lease expires (a retry; the second one quarantines)
            held.clear()
        elif roll < 0.5 or w not in held:  # a second lease abandons the first one until it expires
            t = q.lease(w, now, generation=0)
            if t is not None:
                held[w] = t
        elif roll < 0.85:
            q.done(held.pop(w).task_id, w)
        else:
            t = held.pop(w)
            q.release(t.task_id, w, rng.randrange(t.rows))
        for kind, value in json.loads(json.dumps(q.drain_changes())):
            replica.apply_change(kind, value)
        a, b = q.to_dict(), replica.to_dict()
        assert a == b
    assert replica.finished and replica.summary() == q.summary() and q.poisoned
