"""The public API of recforge.train, recforge.train.recovery and recforge.worker: every exported name resolves to
its defining module's object, and importing the packages loads no torch (their modules are imported on first use)."""
from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

PACKAGES = ["recforge.train", "recforge.train.recovery", "recforge.worker"]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_export_resolves(package):
    pkg = importlib.import_module(package)
    assert pkg.__all__
    submodules = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    assert not submodules & set(pkg.__all__), "an export named like a submodule is replaced by it once imported"
    for name in pkg.__all__:
        module = importlib.import_module(pkg._WHERE[name])
        assert getattr(pkg, name) is getattr(module, name), f"{package}.{name}"
    with pytest.raises(AttributeError, match="no attribute 'not_exported'"):
        pkg.not_exported  # noqa: B018


def test_importing_the_packages_loads_no_torch():
    code = f"import sys; import {', '.join(PACKAGES)}; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
