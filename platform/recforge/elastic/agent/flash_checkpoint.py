"""Flash checkpoints, agent side: persist the workers' shared-memory snapshots to disk.

Runs in the process that launched the workers (run_training_job's supervisor; on Kubernetes next to
torchrun in each worker pod: `python -m recforge.elastic.agent.flash_checkpoint MEMORY_ROOT DISK_ROOT`).
A background thread copies every new complete snapshot (recforge.train.recovery.flash) from shared memory to
`<disk root>/step-N` (temp directory, sha256 of every file into CHECKSUMS.json, fsync, rename; past the page cache:
recforge.elastic.agent.direct_copy) and
keeps the newest `keep`. When a worker dies, `persist_now()` saves what is in memory ("save at
breakpoint"): the snapshot outlives the process that wrote it, tmpfs belongs to the machine.
The memory root must stay a private directory of this user (recforge.train.recovery.private_dir): one that is not is
never persisted from (its snapshots will be unpickled by a restarted group), and never removed.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from recforge.elastic.agent.direct_copy import copy_hashed
from recforge.train.recovery.layout import CHECKSUMS_FILE, memory_problem, prune, step_dirs, step_name
from recforge.train.recovery.private_dir import (
    UnsafeDirectoryError,
    drop_flash_dir,
    ensure_private_dir,
    make_private_root,
    private_dir_problem,
)

log = logging.getLogger(__name__)


class FlashPersister:
    """`pointer`: the file recording `memory_root` (private_dir.write_pointer), removed with it by `cleanup`."""

    def __init__(self, memory_root: str | Path, disk_root: str | Path, *, keep: int = 2, poll_s: float = 0.2,
                 pointer: str | Path | None = None) -> None:
        self.memory_root, self.disk_root = Path(memory_root), Path(disk_root)
        self.keep, self.poll_s = keep, poll_s
        self.pointer = Path(pointer) if pointer is not None else None
        self.refused: str | None = None  # why the memory root was last refused (logged once per reason)
        self.persisted: dict[int, float] = {}  # step -> seconds the copy took
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> FlashPersister:
        try:
            ensure_private_dir(self.memory_root)
        except UnsafeDirectoryError as e:  # the workers refuse it too and checkpoint to disk
            self._refuse(str(e))
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="recforge-flash-persister", daemon=True)
        self._thread.start()
        return self

    def stop(self, persist: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
            self._thread = None
        if persist:
            self.persist_now()

    def cleanup(self) -> None:
        """Free the shared memory (after the job ended and what mattered is on disk) and drop the pointer to it; a
        directory that is not this user's private one is left alone."""
        drop_flash_dir(self.memory_root, self.pointer)

    def on_disk(self) -> bool:
        """The newest complete snapshot in memory (if any) is persisted: the memory may go."""
        found = self.newest_complete()
        return found is None or (self.disk_root / step_name(found[0]) / CHECKSUMS_FILE).exists()

    def newest_complete(self) -> tuple[int, Path] | None:
        for step, path in reversed(step_dirs(self.memory_root)):
            if memory_problem(path) is None:
                return step, path
        return None

    def persist_now(self) -> Path | None:
        """Persist the newest complete snapshot unless it is on disk already; returns its disk path."""
        with self._lock:
            problem = private_dir_problem(self.memory_root)
            if problem is not None:
                if os.path.lexists(self.memory_root):  # absent: nothing written yet (or freed), nothing to refuse
                    self._refuse(f"refusing flash checkpoint directory {self.memory_root}: {problem}")
                return None
            found = self.newest_complete()
            if found is None:
                return None
            step, path = found
            final = self.disk_root / step_name(step)
            if step in self.persisted and (final / CHECKSUMS_FILE).exists():
                return final
            try:
                return self._persist(step, path)
            except FileNotFoundError:  # replaced by a newer snapshot while copying: that one comes next
                log.info("flash snapshot step %d vanished while persisting; skipped", step)
                return None

    def _persist(self, step: int, src: Path) -> Path:
        t0 = time.perf_counter()
        tmp = self.disk_root / (step_name(step) + ".tmp")
        final = self.disk_root / step_name(step)
        shutil.rmtree(tmp, ignore_errors=True)
        make_private_root(self.disk_root)
        tmp.mkdir()
        sums = {}
        for f in sorted(src.iterdir()):
            if not f.is_file() or f.name.startswith("done-rank"):
                continue
            sums[f.name] = copy_hashed(f, tmp / f.name)
        (tmp / (CHECKSUMS_FILE + ".tmp")).write_text(json.dumps(sums, indent=1, sort_keys=True))
        os.replace(tmp / (CHECKSUMS_FILE + ".tmp"), tmp / CHECKSUMS_FILE)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        prune(self.disk_root, self.keep)
        took = time.perf_counter() - t0
        self.persisted[step] = took
        log.info("flash checkpoint step %d persisted to %s in %.3fs", step, final, took)
        return final

    def _refuse(self, why: str) -> None:
        if why != self.refused:
            log.error("%s; its snapshots are not persisted (the workers checkpoint to disk)", why)
        self.refused = why

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.persist_now()
            except Exception:  # keep persisting later snapshots; the failure is logged with its traceback
                log.exception("persisting a flash checkpoint failed")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="persist recforge flash checkpoints from shared memory to disk")
    p.add_argument("memory_root")
    p.add_argument("disk_root")
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--poll-s", type=float, default=0.5)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s flash-agent %(levelname)s: %(message)s")
    persister = FlashPersister(args.memory_root, args.disk_root, keep=args.keep, poll_s=args.poll_s).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    persister.stop(persist=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
