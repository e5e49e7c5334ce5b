"""Copy a file to disk with its sha256, past the page cache (O_DIRECT) where the filesystem allows it.

The flash persister copies each rank's snapshot (~100 MB) from shared memory to disk every checkpoint, in the
launcher's process, on the cores the ranks train on. A buffered copy makes the kernel allocate a new page-cache page
per 4 KiB written; on this project's VMs (free pages handed back to the host) that measured 0.65-1.6 s of system CPU
per 110 MB, against ~0.1 s with O_DIRECT, which writes from the process's own buffer (docs/performance.md, tenth
session). Where O_DIRECT is refused (a filesystem without it, alignment rules) the buffered copy runs instead.
"""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
from pathlib import Path

ALIGN = 4096  # O_DIRECT's offset, length and buffer alignment (covers 512-byte devices too)
CHUNK = 1 << 22


def copy_hashed(src: Path, dst: Path, *, direct: bool = True, chunk: int = CHUNK) -> dict[str, object]:
    """Copy `src` to a new `dst` (fsynced) and return {"sha256", "bytes"} of what was copied."""
    if chunk <= 0 or chunk % ALIGN:
        raise ValueError(f"copy_hashed: chunk {chunk} must be a positive multiple of {ALIGN}")
    if direct:
        try:
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                raise
        else:
            try:
                return _direct(src, fd, chunk)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            finally:
                os.close(fd)
    return _buffered(src, dst, chunk)


def _direct(src: Path, fd: int, chunk: int) -> dict[str, object]:
    h = hashlib.sha256()
    n = 0
    buf = mmap.mmap(-1, chunk)  # page-aligned, reused for every block
    view = memoryview(buf)
    try:
        with open(src, "rb", buffering=0) as fi:
            while True:
                got = _fill(fi, view)
                if not got:
                    break
                h.update(view[:got])
                padded = -(-got // ALIGN) * ALIGN  # the last block goes out whole; the file is cut back below
                _write_all(fd, view[:padded])
                n += got
                if got < chunk:
                    break
        os.ftruncate(fd, n)
        os.fsync(fd)
    finally:
        view.release()
        try:
            buf.close()
        except BufferError:  # slices held by a propagating exception's frames: freed with them
            pass
    return {"sha256": h.hexdigest(), "bytes": n}


def _fill(fi, view: memoryview) -> int:
    """Read into `view` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(view):
        k = fi.readinto(view[got:])
        if not k:
            break
        got += k
    return got


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        k = os.write(fd, data)
        if k <= 0:
            raise OSError(errno.EIO, "copy_hashed: write made no progress")
        data = data[k:]


def _buffered(src: Path, dst: Path, chunk: int) -> dict[str, object]:
    h = hashlib.sha256()
    n = 0
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while block := fi.read(chunk):
            h.update(block)
            fo.write(block)
            n += len(block)
        fo.flush()
        os.fsync(fo.fileno())
    return {"sha256": h.hexdigest(), "bytes": n}
