"""Private directories for a job's local state that is unpickled on load (flash checkpoints, step checkpoints).

A flash checkpoint directory is created with `tempfile.mkdtemp` under /dev/shm (mode 0700, owned by this uid, an
unpredictable name) by the launcher (recforge.elastic.job.run_training_job), which records its path in a pointer file
(`<checkpoint_dir>.flash`, JSON, 0600) so that a resumed job (an Airflow retry) finds the same directory. Every
reader and writer checks it first (`private_dir_problem`): a real directory, not a symlink, owned by this uid, not
writable by group or others. Design: docs/security.md#what-is-unpickled-and-why-it-is-trusted.
Free of torch: the elastic launcher and the flash agent import it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

SHM = Path("/dev/shm")
FLASH_PREFIX = "recforge-flash-"
POINTER_SUFFIX = ".flash"
POINTER_KEY = "flash_root"


class UnsafeDirectoryError(PermissionError):
    """A directory whose contents would be loaded (unpickled) could be written by another user."""


def private_dir_problem(path: str | Path) -> str | None:
    """Why `path` is not a private directory of this user (None: it is). Looks at the entry itself (lstat)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it does not exist"
    except OSError as e:
        return f"it cannot be inspected ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    uid = os.getuid()
    if st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_private_dir(path: str | Path, what: str = "flash checkpoint directory") -> Path:
    """`path` when it is private; else UnsafeDirectoryError naming it and the reason."""
    problem = private_dir_problem(path)
    if problem is not None:
        raise UnsafeDirectoryError(f"refusing {what} {path}: {problem}")
    return Path(path)


def ensure_private_dir(path: str | Path, what: str = "flash checkpoint directory") -> Path:
    """`path`, created 0700 when missing (a worker pod, whose /dev/shm does not hold the launcher's directory), then
    checked (UnsafeDirectoryError). Missing parents are created with the default mode."""
    p = Path(path)
    if not os.path.lexists(p):
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # another rank (or someone else) created it first: the check below decides
            pass
    return check_private_dir(p, what)


def make_private_root(path: str | Path) -> Path:
    """A checkpoint root recforge creates: its last component made 0700 when it is created here; an existing
    directory is left as it is (e.g. a volume shared on purpose)."""
    p = Path(path)
    if not p.is_dir():
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            p.mkdir(mode=0o700)
        except FileExistsError:  # created concurrently (another rank, the flash agent)
            pass
    return p


def new_flash_dir(base: str | Path = SHM) -> Path:
    """A fresh private directory (`tempfile.mkdtemp`: 0700, unpredictable name) under /dev/shm (tmpfs), or under the
    system's temp directory where there is no /dev/shm."""
    where = Path(base)
    if not where.is_dir():
        log.warning("%s does not exist: flash checkpoints go to a private directory under %s", where,
                    tempfile.gettempdir())
        return Path(tempfile.mkdtemp(prefix=FLASH_PREFIX))
    return Path(tempfile.mkdtemp(prefix=FLASH_PREFIX, dir=where))


def pointer_path(checkpoint_dir: str | Path) -> Path:
    p = Path(checkpoint_dir)
    return p.with_name(p.name + POINTER_SUFFIX)


def read_pointer(pointer: str | Path) -> Path | None:
    """The directory a pointer file records (None: no pointer, or one that cannot be read, which is logged)."""
    try:
        data = json.loads(Path(pointer).read_text())
        return Path(data[POINTER_KEY])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("flash pointer %s is unreadable (%s: %s): ignored", pointer, type(e).__name__, e)
        return None


def write_pointer(pointer: str | Path, directory: str | Path) -> Path:
    """Record `directory` in `pointer` (JSON, mode 0600, written to a temp file and renamed into place)."""
    pointer = Path(pointer)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f"{pointer.name}.tmp-{os.getpid()}")
    if os.path.lexists(tmp):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({POINTER_KEY: str(directory), "uid": os.getuid(), "created": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
    return pointer


def open_flash_dir(pointer: str | Path, *, fresh: bool = False, base: str | Path = SHM) -> Path:
    """The job's flash checkpoint directory: the one `pointer` records when it is still private (a resumed job),
    else a new one (recorded in `pointer`), saying why. `fresh` (the job starts over): always a new one; the
    recorded one, when private, is removed."""
    old = read_pointer(pointer)
    if old is not None:
        problem = private_dir_problem(old)
        if fresh:
            if problem is None:
                shutil.rmtree(old, ignore_errors=True)
                log.info("flash checkpoints: removed %s of an earlier run (the job starts over)", old)
        elif problem is None:
            log.info("flash checkpoints: reusing %s (recorded in %s)", old, pointer)
            return old
        else:
            log.warning("flash checkpoint directory %s recorded in %s is not usable (%s): using a fresh one",
                        old, pointer, problem)
    new = new_flash_dir(base)
    write_pointer(pointer, new)
    log.info("flash checkpoints: %s (recorded in %s)", new, pointer)
    return new


def recorded_private_dir(pointer: str | Path) -> Path | None:
    """The directory `pointer` records when it is this user's private one (what a job that starts over removes)."""
    d = read_pointer(pointer)
    return d if d is not None and private_dir_problem(d) is None else None


def drop_flash_dir(directory: str | Path, pointer: str | Path | None = None) -> None:
    """Remove the flash directory (only when it is this user's private one) and the pointer that records it."""
    if private_dir_problem(directory) is None:
        shutil.rmtree(directory, ignore_errors=True)
    if pointer is not None and read_pointer(pointer) == Path(directory):
        Path(pointer).unlink(missing_ok=True)
