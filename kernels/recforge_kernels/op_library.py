"""A torch operator library (TORCH_LIBRARY) compiled from one C++ source on first use and cached on disk.

The build directory is keyed by the source, the flags, the CPU and the torch build (cpu_ext.cache_dir), so later
processes load it without compiling. Where it cannot be built (RECFORGE_NO_CPP=1, no compiler or headers) `ops()`
is None and `status()` says why; callers then take their torch path."""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from recforge_kernels.cpu_ext import MARCH, cache_dir, clear_stale_lock, cpu_signature

log = logging.getLogger(__name__)

OPENMP_FLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-std=c++17"]  # OpenMP: at::parallel_for over torch's threads


class OpLibrary:
    """The ops of `namespace`, defined in `source`; `probe` names one op whose presence proves registration."""

    def __init__(self, namespace: str, source: Path, probe: str, flags: list[str] | None = None) -> None:
        self.namespace, self.source, self.probe = namespace, source, probe
        self.flags = list(flags if flags is not None else OPENMP_FLAGS)
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {}

    def build_name(self) -> str:
        h = hashlib.sha256()
        for part in (self.source.read_bytes(), " ".join(self.flags).encode(), cpu_signature().encode(),
                     f"{torch.__version__} {os.path.dirname(torch.__file__)}".encode()):
            h.update(part)
        return f"{self.namespace}_{h.hexdigest()[:16]}"

    def ops(self) -> Any | None:
        """torch.ops.<namespace> (built on the first call), or None when it cannot be built."""
        if "ops" in self._state:
            return self._state["ops"]
        with self._lock:
            if "ops" in self._state:
                return self._state["ops"]
            if os.environ.get("RECFORGE_NO_CPP") == "1":
                self._state.update(ops=None, why="RECFORGE_NO_CPP=1")
                return None
            try:
                from torch.utils.cpp_extension import load  # lazy: the C++ toolchain glue, only on a build

                build = cache_dir() / self.build_name()
                build.mkdir(parents=True, exist_ok=True)
                clear_stale_lock(build)
                link = ["-fopenmp"] if "-fopenmp" in self.flags else []
                load(name=build.name, sources=[str(self.source)], extra_cflags=self.flags, extra_ldflags=link,
                     build_directory=str(build), is_python_module=False, verbose=False)
                ops = getattr(torch.ops, self.namespace)
                getattr(ops, self.probe)  # raises if the library did not register
                self._state.update(ops=ops, why=f"built in {build}")
            except Exception as e:  # no compiler or headers: the caller's torch path gives the same values
                log.warning("recforge_kernels: %s could not be built (%s); using the torch path", self.namespace, e)
                self._state.update(ops=None, why=repr(e))
            return self._state["ops"]

    def loaded(self) -> Any:
        """The ops, for a caller that already chose the kernels (RuntimeError if they cannot be built)."""
        ops = self.ops()
        if ops is None:
            raise RuntimeError(f"{self.namespace} is not available: {self.status()}")
        return ops

    def status(self) -> str:
        """Why the ops are (not) in use, for logs and reports."""
        return str(self._state.get("why", "not loaded yet"))
