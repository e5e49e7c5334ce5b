"""FailoverPolicy decisions and worker failure records (pure Python, real exceptions)."""
from __future__ import annotations

import pytest

from recforge.elastic.master.failover import (
    FailoverPolicy,
    Failure,
    is_collateral,
    is_oom,
    read_records,
    record_exception,
)


def _raise(exc: BaseException):
    raise exc


def recorded(tmp_path, exc: BaseException, *, rank=0, generation=0):
    try:
        _raise(exc)
    except BaseException as e:
        record_exception(tmp_path, rank=rank, generation=generation, exc=e)
    return read_records(tmp_path, range(generation, generation + 1))


def failure(tmp_path, exc, generation, **kw):
    recs = recorded(tmp_path / f"g{generation}", exc, generation=generation, **kw)
    return Failure.from_launch(1, recs, [generation])


def test_record_names_the_exception_and_the_place(tmp_path):
    (rec,) = recorded(tmp_path, ValueError("bad value 17 in row 3"), rank=1, generation=4)
    assert (rec.rank, rec.generation, rec.exc_type, rec.oom, rec.collateral) == (1, 4, "ValueError", False, False)
    assert "test_elastic_failover.py" in rec.where and "_raise" in rec.where
    assert rec.signature.endswith("bad value # in row #")
    assert "ValueError: bad value 17" in rec.traceback
    assert read_records(tmp_path, range(0, 4)) == []


def test_oom_and_collateral_classification():
    assert is_oom(MemoryError()) and is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 GB"))
    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_oom(ValueError("out of memory"))  # only allocator errors
    assert is_collateral(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"))
    assert is_collateral(ConnectionResetError("reset"))
    assert not is_collateral(KeyError("store"))


def test_same_exception_at_the_same_place_twice_is_not_relaunched(tmp_path):
    policy = FailoverPolicy(max_relaunches=5)
    first = failure(tmp_path, ValueError("schema mismatch in column 3"), 0)
    d1 = policy.decide(first, [], restarts_used=0, batch_size=256, grad_accumulation=1)
    assert d1.relaunch
    second = failure(tmp_path, ValueError("schema mismatch in column 7"), 1)  # numbers differ, place same
    d2 = policy.decide(second, [first], restarts_used=1, batch_size=256, grad_accumulation=1)
    assert not d2.relaunch and "deterministic code error" in d2.reason and "ValueError" in d2.reason
    other = failure(tmp_path, KeyError("x"), 2)
    assert policy.decide(other, [first], restarts_used=1, batch_size=256, grad_accumulation=1).relaunch


def test_collateral_errors_and_kills_never_look_deterministic(tmp_path):
    policy = FailoverPolicy(max_relaunches=5)
    peers = [failure(tmp_path, RuntimeError("[gloo] Connection closed by peer"), g) for g in range(3)]
    assert all(f.kind == "killed" and f.signature is None for f in peers)
    assert policy.decide(peers[2], peers[:2], restarts_used=2, batch_size=8, grad_accumulation=1).relaunch
    killed = Failure.from_launch(-9, [], [7])
    assert killed.kind == "killed" and "died without an exception" in killed.describe()


def test_restart_budget(tmp_path):
    policy = FailoverPolicy(max_relaunches=2)
    f = Failure.from_launch(1, [], [0])
    assert policy.decide(f, [], restarts_used=1, batch_size=8, grad_accumulation=1).relaunch
    d = policy.decide(f, [], restarts_used=2, batch_size=8, grad_accumulation=1)
    assert not d.relaunch and "restart budget exhausted: 2 restart(s) used of 2" in d.reason


def test_oom_halves_the_per_rank_batch_keeping_the_global_batch(tmp_path):
    policy = FailoverPolicy(max_relaunches=5, max_grad_accumulation=4)
    oom = failure(tmp_path, MemoryError("no room"), 0)
    assert oom.kind == "oom"
    d = policy.decide(oom, [], restarts_used=0, batch_size=256, grad_accumulation=1)
    assert d.relaunch and d.grad_accumulation == 2 and "per-rank batch 128 x 2" in d.reason
    d = policy.decide(oom, [oom], restarts_used=1, batch_size=256, grad_accumulation=2)  # OOM twice is no code error
    assert d.relaunch and d.grad_accumulation == 4
    d = policy.decide(oom, [oom], restarts_used=2, batch_size=256, grad_accumulation=4)
    assert not d.relaunch and "cannot halve" in d.reason
    d = policy.decide(oom, [], restarts_used=0, batch_size=6, grad_accumulation=2)  # 6 % 4 != 0
    assert not d.relaunch
    k8s = FailoverPolicy(max_relaunches=5, oom_action="more_memory", memory_growth=2.0)
    d = k8s.decide(oom, [], restarts_used=0, batch_size=256, grad_accumulation=1)
    assert d.relaunch and d.memory_factor == 2.0 and d.grad_accumulation is None


def test_hang_is_relaunched_and_bad_settings_are_refused():
    d = FailoverPolicy(hang_timeout_s=30).decide(Failure.from_launch(None, [], [0], hang=True), [], restarts_used=0,
                                                batch_size=8, grad_accumulation=1)
    assert d.relaunch and "no training progress for 30s" in d.reason
    for kw, match in [({"max_relaunches": -1}, "max_relaunches"), ({"hang_timeout_s": 0}, "hang_timeout_s"),
                      ({"oom_action": "pray"}, "oom_action"), ({"memory_growth": 1.0}, "memory_growth")]:
        with pytest.raises(ValueError, match=match):
            FailoverPolicy(**kw)
