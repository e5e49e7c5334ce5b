"""A package's exports resolved on first use (PEP 562): importing the package stays cheap, and a name's defining
module is imported when the name is first read. A package's `__init__` binds what `lazy_exports` returns:

    __all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {
        "recforge.train.spec": ("WorkerSpec",),  # defining module -> the names it exports
        ...
    })
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple


class LazyExports(NamedTuple):
    """A package's `__all__`, its module-level `__getattr__` and `__dir__`, and each lazy name's defining module."""

    all: list[str]
    getattr: Callable[[str], Any]
    dir: Callable[[], list[str]]
    where: dict[str, str]


def lazy_exports(package: str, modules: Mapping[str, Iterable[str]], *, eager: Iterable[str] = ()) -> LazyExports:
    """The exports of `package`, called from its `__init__` with its `__name__`.

    Args:
        package: the package's name; it is being imported (it is in sys.modules).
        modules: defining module -> the names the package exports from it, imported on first use.
        eager: names the package binds itself (imports at import time or defines); listed in `__all__` too.

    Raises:
        ValueError: a name exported twice, or named like one of the package's submodules (importing that submodule
            would set the package attribute to the module, replacing the export).
    """
    pkg = sys.modules[package]
    owners: dict[str, list[str]] = defaultdict(list)
    for name in eager:
        owners[name].append(package)
    for module, names in modules.items():
        if isinstance(names, str):
            raise ValueError(f"{package}: the names exported from {module} must be a tuple of names, not {names!r}")
        for name in names:
            owners[name].append(module)
    twice = [f"{name} (from {', '.join(where)})" for name, where in owners.items() if len(where) > 1]
    if twice:
        raise ValueError(f"{package}: exported more than once: {'; '.join(twice)}")
    submodules = {m.name for m in pkgutil.iter_modules(getattr(pkg, "__path__", []))}
    clashes = sorted(submodules & owners.keys())
    if clashes:
        raise ValueError(f"{package}: exports named like its submodules (importing one replaces the export): "
                         f"{', '.join(clashes)}")
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}", name=name, obj=pkg)
        return getattr(importlib.import_module(where[name]), name)

    def __dir__() -> list[str]:
        return sorted({*vars(pkg), *where})

    return LazyExports(sorted(owners), __getattr__, __dir__, where)
