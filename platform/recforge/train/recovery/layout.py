"""On-disk layout of checkpoints, free of torch: names, completeness checks, checksums, fingerprints, pruning.

Shared by the workers (recforge.train.recovery.resume, recforge.train.recovery.flash), the final checkpoint
(recforge.train.recovery.checkpoint) and the agent that persists flash checkpoints
(recforge.elastic.agent.flash_checkpoint), which must stay light to import. Every disk checkpoint (step or final)
carries CHECKSUMS.json (sha256 + size of every file), written last; `verify_checkpoint` checks it and raises
naming the file. Its meta carries a fingerprint of the model it holds (model config, tables (name, rows), dense
features, preprocessing plan hash); `check_compatible` says why a checkpoint does not fit the current run.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
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


class CheckpointCorrupt(ValueError):
    """A checkpoint's files do not match its checksums (or it has none): the message names the checkpoint and file."""


class CheckpointIncompatible(ValueError):
    """A checkpoint of another model or plan than the current run's: the message says what differs."""


def verify_checkpoint(path: Path) -> None:
    """Raise CheckpointCorrupt naming the checkpoint and the file unless every file matches CHECKSUMS.json."""
    problem = disk_problem(Path(path))
    if problem is not None:
        raise CheckpointCorrupt(f"checkpoint {path}: {problem}; refusing to load it")


def rank_files(path: Path, rank: int) -> list[Path]:
    """The files rank `rank` writes into a DCP checkpoint directory: its `__<rank>_*.distcp` data, and on rank 0
    also the global `.metadata` and the recforge meta."""
    out = sorted(Path(path).glob(f"__{rank}_*.distcp"))
    if rank == 0:
        out += [p for p in (Path(path) / ".metadata", Path(path) / META_FILE) if p.exists()]
    return out


def write_done_marker(path: Path, rank: int) -> None:
    """Rank `rank` finished writing a flash snapshot: its marker lists the sizes of the files it wrote (a cheap
    check against truncation; the disk copy the agent persists carries sha256), written atomically."""
    sizes = {p.name: p.stat().st_size for p in rank_files(path, rank)}
    tmp = Path(path) / (done_marker(rank) + ".tmp")
    tmp.write_text(json.dumps(sizes, sort_keys=True))
    os.replace(tmp, Path(path) / done_marker(rank))


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
    for r in range(world):
        text = (path / done_marker(r)).read_text()
        try:
            sizes = json.loads(text) if text.strip() else {}  # an empty marker: written before sizes were recorded
        except ValueError:
            return f"{done_marker(r)} unreadable"
        for name, size in sizes.items():
            f = path / name
            if not f.exists() or f.stat().st_size != size:
                have = f.stat().st_size if f.exists() else "no"
                return f"flash checkpoint file {name} has {have} bytes, rank {r} wrote {size}"
    return None


# ---- fingerprint: which model and plan a checkpoint holds --------------------------------------------------
FINGERPRINT_KEY = "fingerprint"


def plan_sha256(plan: Mapping[str, Any]) -> str:
    """sha256 of a preprocessing plan's features (Plan.model_dump(mode="json"); its name does not count): two
    plans that give the model the same inputs hash alike."""
    features = plan.get("features", plan)
    return hashlib.sha256(json.dumps(features, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint(model: Mapping[str, Any], tables: Sequence[tuple[str, int]] | Sequence[list], num_dense: int,
                plan: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint's weights are of: the model config (ModelConfig.model_dump(mode="json")), the embedding
    tables (name, rows) in order, the number of dense features, and the plan's hash (plan_sha256)."""
    return {"model": dict(model), "tables": [[str(n), int(r)] for n, r in tables], "num_dense": int(num_dense),
            "plan_sha256": plan_sha256(plan) if plan is not None else None}


def check_compatible(meta: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """Why a checkpoint (its meta) cannot be loaded into the run whose `fingerprint` is `current`; None: it fits.
    A checkpoint without a fingerprint is refused (nothing says it fits)."""
    saved = meta.get(FINGERPRINT_KEY)
    if not isinstance(saved, Mapping):
        return "the checkpoint records no model/plan fingerprint, so it cannot be shown to match this run"
    diffs: list[str] = []
    model_s, model_c = saved.get("model") or {}, current.get("model") or {}
    for k in sorted(set(model_s) | set(model_c)):
        if model_s.get(k) != model_c.get(k):
            diffs.append(f"model.{k}: checkpoint {model_s.get(k)!r}, this run {model_c.get(k)!r}")
    tables_s = {n: r for n, r in saved.get("tables") or []}
    tables_c = {n: r for n, r in current.get("tables") or []}
    if missing := sorted(set(tables_c) - set(tables_s)):
        diffs.append(f"tables not in the checkpoint: {missing}")
    if extra := sorted(set(tables_s) - set(tables_c)):
        diffs.append(f"tables only in the checkpoint: {extra}")
    for n in sorted(set(tables_s) & set(tables_c)):
        if tables_s[n] != tables_c[n]:
            diffs.append(f"table {n!r}: checkpoint {tables_s[n]} rows, this run {tables_c[n]}")
    if saved.get("num_dense") != current.get("num_dense"):
        diffs.append(f"dense features: checkpoint {saved.get('num_dense')}, this run {current.get('num_dense')}")
    if saved.get("plan_sha256") != current.get("plan_sha256"):
        diffs.append(f"preprocessing plan: checkpoint sha256 {str(saved.get('plan_sha256'))[:12]}, this run "
                     f"{str(current.get('plan_sha256'))[:12]}")
    return "; ".join(diffs) or None


def checkpoint_problem(path: Path, source: str = DISK, current: Mapping[str, Any] | None = None) -> str | None:
    """Why the checkpoint at `path` must not be loaded, or None: integrity (disk: every sha256; memory: complete,
    sizes) and, with `current` (this run's fingerprint), compatibility. The one check every loader runs."""
    problem = memory_problem(path) if source == MEMORY else disk_problem(path)
    if problem is None and current is not None:
        try:
            problem = check_compatible(read_meta(path), current)
        except (OSError, ValueError) as e:
            problem = f"{META_FILE} unreadable ({e})"
        if problem is not None:
            problem = f"another model or plan: {problem}"
    return problem


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
