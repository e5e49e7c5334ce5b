"""The persister's copy past the page cache: the same bytes and sha256 as the file, at every alignment."""
from __future__ import annotations

import errno
import hashlib
import os

import pytest

from recforge.elastic.agent import direct_copy
from recforge.elastic.agent.direct_copy import ALIGN, copy_hashed

CHUNK = 2 * ALIGN
SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


def _source(tmp_path, n: int):
    data = os.urandom(n)
    src = tmp_path / f"src-{n}"
    src.write_bytes(data)
    return src, data


def _direct_supported(tmp_path) -> bool:
    try:
        fd = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    return True


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("direct", [True, False])
def test_copy_is_the_file_and_its_sha256(tmp_path, n, direct):
    src, data = _source(tmp_path, n)
    dst = tmp_path / "dst"
    got = copy_hashed(src, dst, direct=direct, chunk=CHUNK)
    assert dst.read_bytes() == data
    assert got == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": n}


def test_direct_path_runs_here_without_the_buffered_copy(tmp_path, monkeypatch):
    if not _direct_supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT: the buffered copy is the one that runs")
    src, data = _source(tmp_path, 3 * CHUNK + 5)

    def refuse(*a, **k):
        raise AssertionError("the buffered copy ran")

    monkeypatch.setattr(direct_copy, "_buffered", refuse)
    assert copy_hashed(src, tmp_path / "dst", chunk=CHUNK)["bytes"] == len(data)
    assert (tmp_path / "dst").read_bytes() == data


def test_falls_back_to_buffered_where_o_direct_is_refused(tmp_path, monkeypatch):
    src, data = _source(tmp_path, CHUNK + 7)
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "no O_DIRECT here")
        return real_open(path, flags, *a)

    monkeypatch.setattr(direct_copy.os, "open", no_direct)
    got = copy_hashed(src, tmp_path / "dst", chunk=CHUNK)
    assert (tmp_path / "dst").read_bytes() == data
    assert got["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_write_refused_midway_restarts_buffered(tmp_path, monkeypatch):
    src, data = _source(tmp_path, 3 * CHUNK + 5)
    real_write = os.write
    calls = {"n": 0}

    def einval_on_second(fd, buf):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.EINVAL, "unaligned")
        return real_write(fd, buf)

    monkeypatch.setattr(direct_copy.os, "write", einval_on_second)
    got = copy_hashed(src, tmp_path / "dst", chunk=CHUNK)
    assert (tmp_path / "dst").read_bytes() == data
    assert got == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def test_other_errors_are_not_swallowed(tmp_path):
    with pytest.raises(FileNotFoundError):
        copy_hashed(tmp_path / "missing", tmp_path / "dst")
    with pytest.raises(ValueError, match="multiple of 4096"):
        copy_hashed(tmp_path / "missing", tmp_path / "dst", chunk=1000)
