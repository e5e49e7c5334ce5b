"""Flash checkpoints in a private directory (recforge.train.recovery.private_dir): made by run_training_job with
mkdtemp (0700, this uid), recorded in a 0600 pointer a resumed job reuses, refused when another user could write it;
and the model loaders refusing anything but the configured MLflow store's registry (recforge.tracking.model_source).
"""
from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from recforge.config import ResourceConfig
from recforge.elastic.agent.flash_checkpoint import FlashPersister
from recforge.elastic.job import run_training_job
from recforge.elastic.policy import StaticPolicy
from recforge.train.recovery.layout import CHECKSUMS_FILE, step_name
from recforge.train.recovery.private_dir import (
    FLASH_PREFIX,
    SHM,
    UnsafeDirectoryError,
    check_private_dir,
    ensure_private_dir,
    make_private_root,
    new_flash_dir,
    open_flash_dir,
    private_dir_problem,
    read_pointer,
    write_pointer,
)
from recforge.train.recovery.spec import RecoverySpec
from test_elastic_flash import snapshot


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _foreign(d: Path) -> Path:
    """A directory owned by another uid: chown'ed when this test runs as root, else one root owns."""
    if os.getuid() == 0:
        os.chown(d, 4321, -1)
        return d
    return Path("/")


def test_new_flash_dir_is_private_unpredictable_and_under_dev_shm():
    a, b = new_flash_dir(), new_flash_dir()
    try:
        assert a != b and a.name.startswith(FLASH_PREFIX) and len(a.name) > len(FLASH_PREFIX) + 4
        if SHM.is_dir():
            assert a.parent == SHM
        st = os.lstat(a)
        assert _mode(a) == 0o700 and st.st_uid == os.getuid() and private_dir_problem(a) is None
    finally:
        a.rmdir()
        b.rmdir()


def test_private_dir_check_refuses_what_another_user_could_write(tmp_path):
    good = ensure_private_dir(tmp_path / "flash")
    assert _mode(good) == 0o700 and check_private_dir(good) == good
    assert private_dir_problem(tmp_path / "missing") == "it does not exist"

    open_dir = tmp_path / "open_dir"
    open_dir.mkdir()
    os.chmod(open_dir, 0o770)
    with pytest.raises(UnsafeDirectoryError, match=f"refusing flash checkpoint directory {open_dir}: it is writable by "
                                                   r"group or others \(mode 0770\)"):
        check_private_dir(open_dir)
    os.chmod(open_dir, 0o703)
    assert private_dir_problem(open_dir) == "it is writable by group or others (mode 0703)"

    link = tmp_path / "link"
    link.symlink_to(good)  # the target is private; the link itself could be swapped: refused
    assert private_dir_problem(link) == "it is a symbolic link"
    with pytest.raises(UnsafeDirectoryError, match="it is a symbolic link"):
        ensure_private_dir(link)  # an existing link is never followed or replaced

    f = tmp_path / "file"
    f.write_text("x")
    assert private_dir_problem(f) == "it is not a directory"

    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    foreign = _foreign(other)
    assert private_dir_problem(foreign) == f"it is owned by uid {os.lstat(foreign).st_uid}, not by this user " \
                                           f"(uid {os.getuid()})"


def test_checkpoint_roots_recforge_creates_are_0700(tmp_path):
    root = make_private_root(tmp_path / "a" / "ckpt.steps")
    assert _mode(root) == 0o700
    existing = tmp_path / "volume"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    assert _mode(make_private_root(existing)) == 0o755  # a directory that exists is left as it is


def test_pointer_is_0600_json_and_a_resumed_job_reuses_its_directory(tmp_path, caplog):
    pointer = tmp_path / "work" / "steps.flash"
    base = tmp_path / "shm"
    base.mkdir()
    first = open_flash_dir(pointer, base=base)
    assert first.parent == base and _mode(first) == 0o700
    assert _mode(pointer) == 0o600 and json.loads(pointer.read_text())["flash_root"] == str(first)
    assert read_pointer(pointer) == first
    (first / "step-000000004").mkdir()  # a snapshot the killed attempt left
    assert open_flash_dir(pointer, base=base) == first  # the retry: same directory, its snapshot still there
    assert (first / "step-000000004").is_dir()

    # a job that starts over: a new directory, the old one removed
    fresh = open_flash_dir(pointer, fresh=True, base=base)
    assert fresh != first and not first.exists() and read_pointer(pointer) == fresh

    # stale pointers: the directory is gone (tmpfs cleared by a reboot), or no longer private
    fresh.rmdir()
    with caplog.at_level(logging.WARNING, logger="recforge.train.recovery.private_dir"):
        again = open_flash_dir(pointer, base=base)
    assert again != fresh and read_pointer(pointer) == again
    assert f"flash checkpoint directory {fresh} recorded in {pointer} is not usable (it does not exist): using a " \
           f"fresh one" in caplog.text
    os.chmod(again, 0o777)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recforge.train.recovery.private_dir"):
        third = open_flash_dir(pointer, base=base)
    assert third != again and again.exists()  # another user's files may be in it: left alone, not loaded
    assert "is not usable (it is writable by group or others (mode 0777))" in caplog.text

    pointer.write_text("{not json")
    assert read_pointer(pointer) is None  # an unreadable pointer: a fresh directory next time
    write_pointer(pointer, third)
    assert read_pointer(pointer) == third


def test_spec_finds_the_flash_dir_through_the_pointer_only(tmp_path):
    ckpt = tmp_path / "run" / "checkpoint"
    rec = RecoverySpec(flash=True)
    assert rec.flash_pointer(ckpt) == tmp_path / "run" / "checkpoint.flash"
    assert rec.shm_root(ckpt) is None  # no predictable default name any more
    d = ensure_private_dir(tmp_path / "private")
    write_pointer(rec.flash_pointer(ckpt), d)
    assert rec.shm_root(ckpt) == d
    work = RecoverySpec(flash=True, checkpoint_root=tmp_path / "work" / "steps")  # the pipeline: the work dir
    assert work.flash_pointer(ckpt) == tmp_path / "work" / "steps.flash"
    assert RecoverySpec(flash_root=d).shm_root(ckpt) == d


def test_persister_refuses_a_memory_root_another_user_could_write(tmp_path, caplog):
    mem, disk = tmp_path / "mem", tmp_path / "disk"
    snapshot(mem, 10)
    os.chmod(mem, 0o777)
    p = FlashPersister(mem, disk)
    with caplog.at_level(logging.ERROR, logger="recforge.elastic.agent.flash_checkpoint"):
        p.start()
        p.stop(persist=True)
        assert p.persist_now() is None
    assert not (disk / step_name(10)).exists()
    assert f"refusing flash checkpoint directory {mem}: it is writable by group or others (mode 0777); its " \
           f"snapshots are not persisted" in caplog.text
    p.cleanup()
    assert (mem / step_name(10)).is_dir()  # not ours to remove

    os.chmod(mem, 0o700)  # private again: persisted, into a disk root created 0700
    assert p.persist_now() == disk / step_name(10) and (disk / step_name(10) / CHECKSUMS_FILE).exists()
    assert _mode(disk) == 0o700


class RecordingBackend:
    """Launches nothing: records the spec each launch got and whether its flash directory was private then;
    the 'group' exits 0 at once (the master unfinished: run with check=False)."""

    def __init__(self) -> None:
        self.specs: list[dict] = []
        self.problems: list[str | None] = []

    def launch(self, spec_path, plan):
        spec = json.loads(Path(spec_path).read_text())
        self.specs.append(spec)
        self.problems.append(private_dir_problem(spec["recovery"]["flash_root"]))
        return object()

    def wait(self, handle, timeout=None, check=True):
        return 0

    def stop(self, handle):
        pass

    def log_tail(self, handle):
        return ""


def _job(tmp_path, backend, *, resume=True):
    res = ResourceConfig(policy="static", workers=1, threads_per_worker=1, max_restarts=0)
    spec = {"train": {"epochs": 1, "batch_size": 4, "batches_per_task": 1, "lease_timeout_s": 60.0},
            "checkpoint_dir": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "out"),
            "recovery": {"flash": True, "checkpoint_root": str(tmp_path / "work" / "steps")}}
    return run_training_job(spec, [8], resources=res, state_dir=tmp_path / "work" / "master",
                            policy=StaticPolicy(res, cpu_count=1), backend=backend, check=False, resume=resume,
                            timeout_s=60)


def test_run_training_job_makes_reuses_and_removes_the_private_flash_dir(tmp_path):
    pointer = tmp_path / "work" / "steps.flash"
    killed = open_flash_dir(pointer)  # what an attempt killed with SIGKILL left (its pointer and directory)
    b = RecordingBackend()
    _job(tmp_path, b)
    assert b.specs[0]["recovery"]["flash_root"] == str(killed) and b.problems == [None]  # the retry reuses it
    assert not killed.exists() and not pointer.exists()  # the job ended: memory freed, pointer dropped

    b2 = RecordingBackend()
    _job(tmp_path, b2)
    made = Path(b2.specs[0]["recovery"]["flash_root"])
    assert made != killed and made.name.startswith(FLASH_PREFIX) and b2.problems == [None]
    assert not made.exists()

    stale = open_flash_dir(pointer)
    b3 = RecordingBackend()
    _job(tmp_path, b3, resume=False)  # starting over: never the old directory
    assert b3.specs[0]["recovery"]["flash_root"] != str(stale) and not stale.exists()



def test_warm_start_refuses_a_champion_checkpoint_another_user_could_write(tmp_path):
    """(A champion checkpoint of this user loads: tests/unit/test_warm_start.py.)"""
    from recforge.pipelines.context import RunContext
    from recforge.pipelines.hooks import warm_start
    from recforge.pipelines.outputs import PlanOutputs

    ckpt = tmp_path / "runs" / "day1" / "train" / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"pickled by DCP")
    os.chmod(ckpt, 0o777)  # DCP would unpickle a .metadata anyone could have replaced
    day2 = RunContext.create("day2", {}, home=tmp_path)
    plan = PlanOutputs(plan_path=str(tmp_path / "plan.json"), workers=1, threads_per_worker=1, tables=[],
                       num_dense=0, preprocess_executor="fused")
    tags = {warm_start.TAG_CHECKPOINT: str(ckpt), warm_start.TAG_RUN_KEY: "day1"}
    assert warm_start.problems(day2, plan, "1", tags) == [
        f"its checkpoint {ckpt} is refused: it is writable by group or others (mode 0777)"]
