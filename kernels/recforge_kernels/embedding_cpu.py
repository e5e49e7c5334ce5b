"""Builds csrc/embedding_cpu.cpp, the CPU kernel of ``recforge::embedding_layer``, on first use and loads it.

Built with ``torch.utils.cpp_extension.load`` into the kernels' cache (``cpu_ext.cache_dir``:
``$RECFORGE_KERNELS_CACHE``, default ``~/.cache/recforge/torch_extensions``), in a folder keyed by the source and
the header it includes, the compiler flags (the metadata layout of ``embedding_layout`` among them, as -D flags),
the CPU model (it is built with -march=native) and the torch build. There is no fallback: a failed build raises.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from recforge_kernels.cpu_ext import cache_dir, clear_stale_lock, cpu_signature
from recforge_kernels.embedding_layout import cpp_macros

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "embedding_cpu.cpp"
HEADERS = (CSRC / "sigrid_hash.h",)  # included by SOURCE: part of the build key
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]

_lock = threading.Lock()
_module = None


def flags() -> list[str]:
    """Compiler flags: CFLAGS and the metadata layout's macros."""
    return CFLAGS + [f"-D{name}={value}" for name, value in cpp_macros().items()]


def build_name() -> str:
    """recforge_embedding_<key>; the key hashes everything that changes the binary (see the module docstring)."""
    h = hashlib.sha256()
    # The torch build is part of the key: two checkouts with their own venvs sharing one cache would otherwise
    # rebuild the same directory in turn (its ninja file names each venv's include paths).
    for part in (SOURCE.read_bytes(), *(hdr.read_bytes() for hdr in HEADERS), " ".join(flags()).encode(),
                 cpu_signature().encode(), f"{torch.__version__} {os.path.dirname(torch.__file__)}".encode()):
        h.update(part)
    return f"recforge_embedding_{h.hexdigest()[:16]}"


def module():
    """The compiled extension (built on first call; later processes load it from the cache)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            name = build_name()
            build = cache_dir() / name
            build.mkdir(parents=True, exist_ok=True)
            clear_stale_lock(build)
            _module = load(name=name, sources=[str(SOURCE)], extra_cflags=flags(), extra_ldflags=["-fopenmp"],
                           build_directory=str(build), verbose=False)
    return _module
