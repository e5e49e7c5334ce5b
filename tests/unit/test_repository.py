"""The repository stands alone: no tracked file refers to the source-material folder beside the checkout or to an
absolute path of some machine, and no build output or other binary is committed (a stray wheel, a .so).

Design documents live in docs/, test data in tests/data/. The scan covers every file `git ls-files` lists.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Names spelled in parts, so that no line of this file is itself a reference: the folder beside the checkout
# and this project's machine roots (an image's own home directory is fine).
OUTSIDE = "shar" "ed"
_MACHINE_ROOTS = ("wo" "rk", "ro" "ot")
REFERENCE_PATTERNS: dict[str, re.Pattern[str]] = {
    # a relative or bare path into the folder (not the word in prose, "... memory", "/dev/shm")
    f"folder outside the repository ({OUTSIDE}/)": re.compile(r"(?:^|[\s\"'`(\[<=:/])" + OUTSIDE + r"/"),
    # the folder joined as a path component: Path(...).parent / "<folder>", os.path.join(root, "<folder>")
    f"folder outside the repository ({OUTSIDE} path join)": re.compile(
        r"""(?:/|,)\s*["']""" + OUTSIDE + r"""["']"""),
    "absolute machine path": re.compile(r"(?<![\w.~$-])/(?:" + "|".join(_MACHINE_ROOTS) + r")/[\w.-]"),
}

BINARY_SUFFIXES = (
    ".whl", ".egg", ".so", ".pyd", ".dylib", ".dll", ".exe", ".o", ".a", ".pt", ".pt2", ".pth", ".pkl",
    ".pickle", ".npy", ".npz", ".parquet", ".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz",
)
ALLOWED_BINARIES: dict[str, str] = {}  # path -> why it must be committed; nothing so far


def find_references(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for every reference to a folder outside the repo or a machine path."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for what, pattern in REFERENCE_PATTERNS.items():
            if pattern.search(line):
                found.append((lineno, what, line.strip()[:160]))
    return found


def is_binary(path: Path) -> bool:
    """A committed build output or binary: a known binary suffix, or a NUL byte in the first 8 KiB."""
    if path.name.endswith(BINARY_SUFFIXES):
        return True
    with path.open("rb") as f:
        return b"\0" in f.read(8192)


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p and (root / p).is_file()]


def scan(root: Path) -> list[str]:
    """Every problem as "path:line: what: text" (binaries as "path: committed binary")."""
    problems = []
    for rel in tracked_files(root):
        path = root / rel
        if is_binary(path):
            if rel not in ALLOWED_BINARIES:
                problems.append(f"{rel}: committed binary (build output, wheel or data blob)")
            continue
        for lineno, what, line in find_references(path.read_text(encoding="utf-8", errors="replace")):
            problems.append(f"{rel}:{lineno}: {what}: {line}")
    return problems


needs_git = pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and a git checkout"
)


@needs_git
def test_repository_has_no_outside_references_or_binaries():
    problems = scan(REPO)
    assert not problems, "point to docs/ or tests/data/ instead:\n" + "\n".join(problems)


def _plant(template: str) -> str:
    """A sample line with the folder ({out}) and the machine roots ({work}, {root}) filled in."""
    return template.format(out=OUTSIDE, work=_MACHINE_ROOTS[0], root=_MACHINE_ROOTS[1])


@pytest.mark.parametrize("template", [
    "Design: `/{work}/{out}/DESIGN.md`.",
    '"""RAP co-running (ASPLOS \'24; ../{out}/papers/RAP.md): run fused ..."""',
    "model (`{out}/papers/DLRover-RM.md`); the code is the reference.",
    'SAMPLE = Path(__file__).resolve().parents[3] / "{out}" / "data" / "sample.tsv"',
    "SAMPLES = REPO.parent / '{out}'",
    "data = os.path.join(root, \"{out}\", \"data\")",
    '  File "/{work}/main/platform/recforge/worker/main.py", line 162, in main',
    "cache: /{root}/.cache/recforge",
])
def test_matcher_finds_planted_references(template):
    line = _plant(template)
    found = find_references("first line\n" + line + "\n")
    assert [n for n, _, _ in found] == [2] * len(found) and found, line


@pytest.mark.parametrize("template", [
    "Flash checkpoints copy tensors into {out} memory (/dev/shm) with no pickling.",
    "torch.multiprocessing {out}_memory tensors; a {out} box's CPU time",
    "the ranks read the task's rows from the {out} shards",
    "see docs/rap.md and tests/data/README.md",
    "https://example.com/{work}/{out}-things and github.com/owner/{work}/x",
    "RECFORGE_HOME=$HOME/.recforge; ~/{work}/notes",
])
def test_matcher_leaves_ordinary_text_alone(template):
    line = _plant(template)
    assert find_references(line) == [], line


@needs_git
def test_scan_names_file_and_line_of_a_planted_reference(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "README.md").write_text(_plant("# x\n\nDesign: see ../{out}/DESIGN.md.\n"))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(_plant('"""Uses {out} memory."""\nCACHE = "/{root}/.cache/x"\n'))
    (tmp_path / "tool-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 not really a wheel")
    (tmp_path / "blob.dat").write_bytes(b"abc\0def")
    (tmp_path / "untracked.md").write_text(_plant("see ../{out}/papers/RAP.md\n"))  # not in git: not scanned
    subprocess.run(["git", "add", "README.md", "pkg/mod.py", "tool-1.0-py3-none-any.whl", "blob.dat"],
                   cwd=tmp_path, check=True)
    problems = scan(tmp_path)
    assert [p.split(": ")[0] for p in problems] == [
        "README.md:3", "blob.dat", "pkg/mod.py:2", "tool-1.0-py3-none-any.whl"], problems
    assert "folder outside the repository" in problems[0] and "absolute machine path" in problems[2]
    assert "committed binary" in problems[1] and "committed binary" in problems[3]
