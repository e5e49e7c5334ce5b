"""The file-level fault injectors of recforge.pipelines.faults (the fault matrix's checkpoint faults)."""
from __future__ import annotations

import errno

import pytest

from recforge.pipelines.faults import (
    SpaceLimitUnavailable,
    corrupt_random,
    grow_filesystem,
    newest_checkpoint,
    small_filesystem,
    wait_for,
)
from recforge.train.recovery.layout import disk_problem, step_name, write_checksums


def test_random_bytes_keep_the_size_and_fail_the_checksum_naming_the_file(tmp_path):
    for step in (10, 20):
        d = tmp_path / step_name(step)
        d.mkdir()
        (d / ".metadata").write_bytes(b"m" * 100)
        (d / "recforge_checkpoint.json").write_text("{}")
        (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
        write_checksums(d)
    newest = newest_checkpoint(tmp_path)
    assert newest.name == step_name(20)
    victim = newest / "__0_0.distcp"
    before = victim.read_bytes()
    offset, n = corrupt_random(victim, nbytes=64)
    after = victim.read_bytes()
    assert len(after) == len(before) and after != before and after[:offset] == before[:offset]
    assert disk_problem(newest) == "__0_0.distcp sha256 mismatch"
    assert disk_problem(tmp_path / step_name(10)) is None


def test_no_complete_checkpoint_is_named(tmp_path):
    (tmp_path / step_name(5)).mkdir()  # no CHECKSUMS.json: never completed
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        newest_checkpoint(tmp_path)


def test_a_small_filesystem_fills_then_grows(tmp_path):
    try:
        with small_filesystem(tmp_path / "fs", 256 * 1024) as fs:
            with pytest.raises(OSError) as err:
                (fs / "big").write_bytes(b"x" * (512 * 1024))
            assert err.value.errno == errno.ENOSPC
            grow_filesystem(fs, 2 * 1024 * 1024)
            (fs / "big").write_bytes(b"x" * (512 * 1024))
            assert (fs / "big").stat().st_size == 512 * 1024
    except SpaceLimitUnavailable as e:
        pytest.skip(f"mounting a tmpfs is not allowed here: {e}")
    assert not (tmp_path / "fs" / "big").exists()  # unmounted: the directory underneath is empty


def test_wait_for_names_what_it_waited_for():
    with pytest.raises(TimeoutError, match="timed out after 0s waiting for the moon"):
        wait_for("the moon", lambda: False, timeout_s=0.2)
