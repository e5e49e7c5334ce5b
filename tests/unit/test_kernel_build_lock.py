"""A build lock a killed C++ build left behind is cleared (torch's FileBaton would wait on it forever)."""
import os
import time

from recforge_kernels.cpu_ext import STALE_LOCK_S, clear_stale_lock


def test_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running right now
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    clear_stale_lock(tmp_path)
    assert not lock.exists()
    clear_stale_lock(tmp_path)  # no lock: nothing to do
