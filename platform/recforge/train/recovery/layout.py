"""On-disk layout of step checkpoints, free of torch: names, completeness checks, checksums, pruning.

Shared by the workers (recforge.train.recovery.resume, recforge.train.recovery.flash) and the agent that persists
flash checkpoints (recforge.elastic.agent.flash_checkpoint), which must stay light to import.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

META_FILE = "recforge_checkpoint.json"
CHECKSUMS_FILE = "CHECKSUMS.json"
_STEP_RE = re.compile(r"^step-(\d{9})$")
MEMORY, DISK = "memory", "disk"


def step_name(step: int) -> str:
    return f"step-{step:09d}"


def done_marker(rank: int) -> str:
    return f"done-rank{rank}"


@dataclass(frozen=True)
class Candidate:
    path: Path
    step: int
    source: str  # MEMORY | DISK


def step_dirs(root: Path | None) -> list[tuple[int, Path]]:
    if root is None or not Path(root).is_dir():
        return []
    out = []
    for p in Path(root).iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def candidates(disk_root: Path | None, memory_root: Path | None) -> list[Candidate]:
    """Every checkpoint directory, newest first; memory before disk at the same step."""
    c = [Candidate(p, s, MEMORY) for s, p in step_dirs(memory_root)]
    c += [Candidate(p, s, DISK) for s, p in step_dirs(disk_root)]
    return sorted(c, key=lambda x: (-x.step, x.source != MEMORY))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checkpoint_files(path: Path) -> list[Path]:
    """The files a checkpoint consists of (DCP data + .metadata + our meta), not the markers."""
    return sorted(p for p in Path(path).iterdir()
                  if p.is_file() and p.name != CHECKSUMS_FILE and not p.name.startswith("done-rank"))


def write_checksums(path: Path) -> None:
    sums = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in checkpoint_files(path)}
    tmp = Path(path) / (CHECKSUMS_FILE + ".tmp")
    tmp.write_text(json.dumps(sums, indent=1, sort_keys=True))
    os.replace(tmp, Path(path) / CHECKSUMS_FILE)


def disk_problem(path: Path, deep: bool = True) -> str | None:
    """Why the disk checkpoint at `path` cannot be used, or None. `deep`: verify every sha256."""
    path = Path(path)
    sums_path = path / CHECKSUMS_FILE
    if not sums_path.exists():
        return f"{CHECKSUMS_FILE} missing (the save never completed)"
    if not deep:
        return None
    try:
        sums = json.loads(sums_path.read_text())
    except ValueError as e:
        return f"{CHECKSUMS_FILE} unreadable ({e})"
    for name in (".metadata", META_FILE):
        if name not in sums:
            return f"{name} not listed in {CHECKSUMS_FILE}"
    for name, want in sums.items():
        f = path / name
        if not f.exists():
            return f"{name} missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, expected {want['bytes']}"
        if sha256_file(f) != want["sha256"]:
            return f"{name} sha256 mismatch"
    return None


def memory_problem(path: Path) -> str | None:
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.exists() or not (path / ".metadata").exists():
        return "incomplete flash checkpoint (no metadata)"
    try:
        world = int(json.loads(meta_path.read_text())["world_size"])
    except (ValueError, KeyError) as e:
        return f"{META_FILE} unreadable ({e})"
    missing = [r for r in range(world) if not (path / done_marker(r)).exists()]
    if missing:
        return f"incomplete flash checkpoint: ranks {missing} never finished writing"
    return None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / META_FILE).read_text())


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete disk checkpoints (and stale temp directories)."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    complete = [p for _, p in step_dirs(root) if (p / CHECKSUMS_FILE).exists()]
    for p in complete[:-keep] if keep > 0 else complete:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed
