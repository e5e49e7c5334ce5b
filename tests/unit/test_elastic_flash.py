"""Checkpoint layout, the flash-checkpoint persister (agent side) and the per-sample ledger, on plain files.

The DCP files here are stand-ins (random bytes): what is tested is completeness, checksums, copying,
pruning and the lineage arithmetic; tests/integration/test_fault_*.py run them with real checkpoints.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from recforge.elastic.agent.flash_checkpoint import FlashPersister
from recforge.train.loop.ledger import Ledger, audit
from recforge.train.recovery.layout import (
    CHECKSUMS_FILE,
    META_FILE,
    candidates,
    disk_problem,
    done_marker,
    memory_problem,
    prune,
    step_name,
    write_checksums,
    write_done_marker,
)


def snapshot(root, step, world=2, complete=True, size=1000):
    d = root / step_name(step)
    d.mkdir(parents=True)
    for r in range(world):
        (d / f"__{r}_0.distcp").write_bytes(os.urandom(size) + bytes([step % 256]))
    (d / ".metadata").write_bytes(b"meta" + bytes([step % 256]))
    (d / META_FILE).write_text(json.dumps({"step": step, "world_size": world}))
    for r in range(world if complete else world - 1):
        (d / done_marker(r)).touch()
    return d


def test_memory_snapshot_is_complete_only_with_every_rank_marker(tmp_path):
    assert memory_problem(snapshot(tmp_path, 10)) is None
    assert "ranks [1] never finished" in memory_problem(snapshot(tmp_path, 20, complete=False))
    d = tmp_path / step_name(30)
    d.mkdir()
    assert "no metadata" in memory_problem(d)


def test_memory_snapshot_markers_carry_the_sizes_each_rank_wrote(tmp_path):
    d = snapshot(tmp_path, 40)
    for r in (0, 1):
        write_done_marker(d, r)
    assert json.loads((d / done_marker(1)).read_text()) == {"__1_0.distcp": 1001}
    assert set(json.loads((d / done_marker(0)).read_text())) == {"__0_0.distcp", ".metadata", META_FILE}
    assert memory_problem(d) is None
    (d / "__1_0.distcp").write_bytes(b"cut short")
    assert memory_problem(d) == "flash checkpoint file __1_0.distcp has 9 bytes, rank 1 wrote 1001"


def test_disk_checksums_catch_corruption_truncation_and_missing_files(tmp_path):
    d = snapshot(tmp_path, 5)
    assert "never completed" in disk_problem(d)
    write_checksums(d)
    assert disk_problem(d) is None and set(json.loads((d / CHECKSUMS_FILE).read_text())) == {
        "__0_0.distcp", "__1_0.distcp", ".metadata", META_FILE}
    data = bytearray((d / "__1_0.distcp").read_bytes())
    data[10] ^= 0xFF
    (d / "__1_0.distcp").write_bytes(bytes(data))
    assert disk_problem(d) == "__1_0.distcp sha256 mismatch"
    assert disk_problem(d, deep=False) is None  # the cheap check only looks for completion
    (d / "__1_0.distcp").write_bytes(bytes(data[:-3]))
    assert "bytes, expected" in disk_problem(d)
    (d / "__1_0.distcp").unlink()
    assert disk_problem(d) == "__1_0.distcp missing"


def test_candidates_newest_first_memory_before_disk(tmp_path):
    mem, disk = tmp_path / "mem", tmp_path / "disk"
    for s in (10, 30):
        snapshot(mem, s)
    for s in (20, 30):
        snapshot(disk, s)
    (disk / "step-000000040.tmp").mkdir()  # an unfinished save is never a candidate
    got = [(c.step, c.source) for c in candidates(disk, mem)]
    assert got == [(30, "memory"), (30, "disk"), (20, "disk"), (10, "memory")]


def test_prune_keeps_the_newest_complete(tmp_path):
    for s in (1, 2, 3, 4):
        write_checksums(snapshot(tmp_path, s))
    snapshot(tmp_path, 5)  # incomplete: neither counted nor deleted
    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(3), step_name(4), step_name(5)]


def test_persister_copies_complete_snapshots_with_checksums(tmp_path):
    mem, disk = tmp_path / "mem", tmp_path / "disk"
    p = FlashPersister(mem, disk, keep=2, poll_s=0.02).start()
    try:
        src = snapshot(mem, 10)
        snapshot(mem, 20, complete=False)  # being written: not persisted
        for _ in range(500):  # bounded wait for the background thread
            if (disk / step_name(10) / CHECKSUMS_FILE).exists():
                break
            time.sleep(0.01)
        out = disk / step_name(10)
        assert disk_problem(out) is None
        assert (out / "__0_0.distcp").read_bytes() == (src / "__0_0.distcp").read_bytes()
        assert not (out / done_marker(0)).exists() and not (disk / step_name(20)).exists()
    finally:
        p.stop(persist=False)
    # the workers died after writing step 30: the agent persists it at the breakpoint
    snapshot(mem, 30)
    assert p.persist_now() == disk / step_name(30)
    assert disk_problem(disk / step_name(30)) is None
    assert p.persist_now() == disk / step_name(30)  # idempotent
    snapshot(mem, 40)
    assert not p.on_disk()  # the newest snapshot lives only in memory: it must not be freed yet
    p.persist_now()
    assert p.on_disk()
    assert sorted(x.name for x in disk.iterdir()) == [step_name(30), step_name(40)]  # keep=2
    p.cleanup()
    assert not mem.exists()


def _train(ledger, epoch, shard, a, b):
    ledger.record(epoch, shard, a, b)


def test_ledger_lineage_follows_the_checkpoint_chain(tmp_path):
    # generation 0 trains rows 0-39 of shard 0, checkpoints at step 2 (after rows 0-19) and dies.
    g0 = [Ledger(tmp_path, 0, r) for r in range(2)]
    g0[0].start(None, None, world_size=2)
    _train(g0[0], 0, 0, 0, 10)
    _train(g0[1], 0, 0, 10, 20)
    for lg in g0:
        lg.mark_checkpoint(2)
    _train(g0[0], 0, 0, 20, 30)
    _train(g0[1], 0, 0, 30, 40)  # lost with generation 0
    # generation 1 resumes from step 2 of generation 0 (world size 1) and trains rows 20-50.
    g1 = Ledger(tmp_path, 1, 0, since=2)
    g1.start(2, 0, world_size=1)
    _train(g1, 0, 0, 20, 50)
    for lg in (*g0, g1):
        lg.close()
    a = audit(tmp_path)
    assert a.chain == [1, 0]
    assert set(a.lineage) == {(0, 0, r) for r in range(50)} and set(a.lineage.values()) == {1}
    assert set(a.redone) == {(0, 0, r) for r in range(20, 40)}
    assert a.trained[(0, 0, 25)] == 2 and a.trained[(0, 0, 45)] == 1


def test_ledger_ignores_a_torn_last_line_and_names_a_missing_generation(tmp_path):
    lg = Ledger(tmp_path, 3, 0)
    lg.start(7, 2, world_size=1)
    _train(lg, 0, 1, 0, 4)
    lg.close()
    with open(tmp_path / "gen0003-rank0.jsonl", "a") as f:
        f.write('{"e": 0, "s": 1, "a": 4')  # killed mid-write
    with pytest.raises(ValueError, match="generation 2 is referenced"):
        audit(tmp_path)
    g2 = Ledger(tmp_path, 2, 0)
    g2.start(None, None, world_size=1)
    g2.close()
    a = audit(tmp_path)
    assert a.chain == [3, 2] and sum(a.lineage.values()) == 4  # the torn line never counts
    with pytest.raises(FileNotFoundError, match="no ledger"):
        audit(tmp_path / "empty")
