"""Builds csrc/fused_cpu.cpp on first use (torch.utils.cpp_extension.load) and loads its `recforge_cpu` ops.

Why C++: the same ops as vectorized torch pay one pass over memory (and an allocation) per arithmetic step, and
the 64-bit hash is ~25 steps; bench/bench_preprocess.py measures the difference. The build is cached under
$RECFORGE_KERNELS_CACHE, else ~/.cache/recforge/torch_extensions (see cache_dir; the embedding op's build shares
it), in a folder named after a hash of the source, the flags, the torch version and this CPU's model and flags.

Target: the extension is compiled where it runs (at first use), for that CPU: -march=$RECFORGE_CPU_MARCH, "native" by
default, so every loop auto-vectorizes for the widest ISA the machine has, and the build key carries the CPU's model
and flags, so a cache never travels to another CPU. A shared or prebuilt cache (a CI image) sets e.g.
RECFORGE_CPU_MARCH=x86-64-v2: the hand-written AVX2 loops (the sigrid hash + floor-mod, the int64 -> float32 fill
and cast, the chain kernel's tile transposes of the values, its 32-byte streaming stores) are compiled by a target
attribute and chosen at run time (__builtin_cpu_supports), each with a scalar form, so a portable build loses only
the auto-vectorized and Sleef float64 loops. Set RECFORGE_NO_CPP=1 to skip the build: the fused ops then run their
torch fallback. Build failures are logged once and fall back the same way.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "fused_cpu.cpp"
HEADERS = (Path(__file__).parent / "csrc" / "sigrid_hash.h",)  # included by SOURCE: part of the build key
MARCH = os.environ.get("RECFORGE_CPU_MARCH", "native")  # see the module docstring
FLAGS = ["-O3", f"-march={MARCH}", "-fno-math-errno", "-std=c++17"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_signature() -> str:
    """This CPU's model and flags, for build keys (the kernels are built for the CPU they run on)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """$RECFORGE_KERNELS_CACHE, else ~/.cache/recforge/torch_extensions (not $RECFORGE_HOME: tests and pipeline
    runs use throwaway homes, and every one would rebuild), else $RECFORGE_HOME/torch_extensions without a home."""
    if os.environ.get("RECFORGE_KERNELS_CACHE"):
        return Path(os.environ["RECFORGE_KERNELS_CACHE"])
    try:
        return Path.home() / ".cache" / "recforge" / "torch_extensions"
    except RuntimeError:  # no home directory
        return Path(os.environ.get("RECFORGE_HOME", ".recforge")) / "torch_extensions"


def build_name() -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), *(hdr.read_bytes() for hdr in HEADERS), " ".join(FLAGS).encode(),
                 torch.__version__.encode(), cpu_signature().encode()):
        h.update(part)
    return f"recforge_fused_cpu_{h.hexdigest()[:16]}"


STALE_LOCK_S = 600.0  # a build takes ~40 s; a lock this old was left by a build that was killed


def clear_stale_lock(build: Path) -> None:
    """torch's build lock (FileBaton) waits forever on a lock file a killed build left behind: remove an old one."""
    lock = build / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("recforge_kernels: removing a stale build lock %s (older than %.0f s)", lock, STALE_LOCK_S)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def load(verbose: bool = False) -> bool:
    """Build (first time) and load the extension; True when `torch.ops.recforge_cpu` is usable."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("RECFORGE_NO_CPP") == "1":
            _state["ok"], _state["why"] = False, "RECFORGE_NO_CPP=1"
            return False
        try:
            from torch.utils.cpp_extension import load as load_ext  # lazy: the C++ toolchain glue, only on a build

            name = build_name()
            build = cache_dir() / name
            build.mkdir(parents=True, exist_ok=True)
            clear_stale_lock(build)
            load_ext(name=name, sources=[str(SOURCE)], extra_cflags=FLAGS, build_directory=str(build),
                     is_python_module=False, verbose=verbose)
            torch.ops.recforge_cpu.sigrid_hash  # noqa: B018 (raises if the library did not register)
            _state["ok"], _state["why"] = True, f"built in {build}"
        except Exception as e:  # no compiler, headers, ...: the torch fallback still gives the same values
            log.warning("recforge_kernels: the C++ CPU kernels could not be built (%s); using the torch fallback", e)
            _state["ok"], _state["why"] = False, repr(e)
        return bool(_state["ok"])


def status() -> str:
    """Why the extension is (not) in use, for logs and benchmark reports."""
    return str(_state.get("why", "not loaded yet"))
