"""Package exports resolved on first use (recforge.exports.lazy_exports): the helper itself, and every recforge
package that uses it (found from the sources, so a new one is covered): each export resolves to its defining
module's object, unknown names raise AttributeError, and importing the packages stays light."""
from __future__ import annotations

import ast
import importlib
import json
import pickle
import subprocess
import sys
import types
from pathlib import Path

import pytest

from recforge.exports import lazy_exports

SOURCE_ROOT = Path(__file__).resolve().parents[2] / "platform"


def _uses_the_helper(init: Path) -> bool:
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy_exports"
               for node in ast.walk(ast.parse(init.read_text())))


PACKAGES = [".".join(init.parent.relative_to(SOURCE_ROOT).parts)
            for init in sorted((SOURCE_ROOT / "recforge").rglob("__init__.py")) if _uses_the_helper(init)]

# Heavy imports a lazily exporting package keeps off its import (the reason it exports lazily): torch / torchrec for
# rap, train and worker, mlflow for tracking, FastAPI / scipy for elastic's master and optimizer and the simulator.
HEAVY = ("torch", "torchrec", "mlflow", "fastapi", "scipy")


def test_the_packages_are_found() -> None:
    assert {"recforge.rap", "recforge.rap.profiling", "recforge.rap.planning", "recforge.rap.mapping",
            "recforge.rap.runtime", "recforge.train", "recforge.train.recovery", "recforge.worker",
            "recforge.tracking", "recforge.preprocess", "recforge.elastic", "recforge.elastic.master",
            "recforge.elastic.agent", "recforge.elastic.simulate"} <= set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_export_resolves(package: str) -> None:
    pkg = importlib.import_module(package)
    assert pkg.__all__
    assert set(pkg._WHERE) <= set(pkg.__all__)
    for name in pkg.__all__:
        if name in pkg._WHERE:
            assert getattr(pkg, name) is getattr(importlib.import_module(pkg._WHERE[name]), name), f"{package}.{name}"
        else:  # bound by the package itself
            assert name in vars(pkg), f"{package}.{name} is in __all__ but the package does not define it"
    assert set(pkg.__all__) <= set(dir(pkg))
    with pytest.raises(AttributeError, match=f"^module '{package}' has no attribute 'not_exported'$"):
        pkg.not_exported  # noqa: B018


@pytest.mark.parametrize("package", PACKAGES)
def test_type_checking_imports_match_the_exports(package: str) -> None:
    """A package's `if TYPE_CHECKING:` imports (the exports' types for mypy) name its lazy exports, each from the
    module it resolves from."""
    pkg = importlib.import_module(package)
    tree = ast.parse(Path(pkg.__file__ or "").read_text())
    blocks = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    typed = {alias.name: node.module for block in blocks for node in block.body
             if isinstance(node, ast.ImportFrom) for alias in node.names}
    if typed:
        assert typed == pkg._WHERE


# Imports each package in turn; prints, for each, the heavy modules its import loaded first.
LIGHTNESS = """
import importlib, json, sys
heavy, loaded = sys.argv[1].split(","), {}
for package in sys.argv[2:]:
    importlib.import_module(package)
    loaded[package] = [m for m in heavy if m in sys.modules and all(m not in v for v in loaded.values())]
print(json.dumps(loaded))
"""


def test_importing_the_packages_stays_light() -> None:
    out = subprocess.run([sys.executable, "-c", LIGHTNESS, ",".join(HEAVY), *PACKAGES], capture_output=True,
                         text=True, check=True, timeout=120)
    loaded = {package: heavy for package, heavy in json.loads(out.stdout).items() if heavy}
    assert not loaded, f"importing these packages loads heavy modules: {loaded}"


# ------------------------------------------------------------------ the helper


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """An empty package `fakepkg` being imported, with submodules `sub` and `subpkg`."""
    (tmp_path / "sub.py").write_text("")
    (tmp_path / "subpkg").mkdir()
    (tmp_path / "subpkg" / "__init__.py").write_text("")
    module = types.ModuleType("fakepkg")
    module.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "fakepkg", module)
    return module


def test_exports_resolve_on_first_use(package: types.ModuleType) -> None:
    package.VERSION = 1
    exports = lazy_exports("fakepkg", {"json": ("dumps", "loads"), "pickle": ("HIGHEST_PROTOCOL",)},
                           eager=("VERSION",))
    assert exports.all == ["HIGHEST_PROTOCOL", "VERSION", "dumps", "loads"]
    assert exports.where == {"dumps": "json", "loads": "json", "HIGHEST_PROTOCOL": "pickle"}
    package.__getattr__, package.__dir__ = exports.getattr, exports.dir
    assert package.dumps is json.dumps and package.HIGHEST_PROTOCOL == pickle.HIGHEST_PROTOCOL
    assert {"VERSION", "dumps", "loads", "HIGHEST_PROTOCOL"} <= set(dir(package))


def test_an_unknown_name_raises_attribute_error(package: types.ModuleType) -> None:
    package.__getattr__ = lazy_exports("fakepkg", {"json": ("dumps",)}).getattr
    with pytest.raises(AttributeError, match=r"^module 'fakepkg' has no attribute 'dump'$") as err:
        package.dump  # noqa: B018
    assert err.value.name == "dump" and err.value.obj is package


@pytest.mark.parametrize(("modules", "eager"), [
    ({"json": ("dumps",), "pickle": ("dumps",)}, ()),
    ({"json": ("dumps", "dumps")}, ()),
    ({"json": ("dumps",)}, ("dumps",)),
], ids=["two-modules", "one-module", "eager-and-lazy"])
def test_a_name_exported_twice_is_refused(package: types.ModuleType, modules: dict[str, tuple[str, ...]],
                                          eager: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match=r"fakepkg: exported more than once: dumps \(from "):
        lazy_exports("fakepkg", modules, eager=eager)


@pytest.mark.parametrize(("modules", "eager"), [
    ({"json": ("dumps", "sub")}, ()), ({"json": ("subpkg",)}, ()), ({}, ("sub",)),
], ids=["module", "subpackage", "eager"])
def test_a_name_clashing_with_a_submodule_is_refused(package: types.ModuleType, modules: dict[str, tuple[str, ...]],
                                                     eager: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="fakepkg: exports named like its submodules .*: sub"):
        lazy_exports("fakepkg", modules, eager=eager)


def test_names_given_as_one_string_are_refused(package: types.ModuleType) -> None:
    with pytest.raises(ValueError, match="must be a tuple of names, not 'dumps'"):
        lazy_exports("fakepkg", {"json": "dumps"})


def test_a_clash_fails_the_package_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "clashpkg").mkdir()
    (tmp_path / "clashpkg" / "__init__.py").write_text(
        "from recforge.exports import lazy_exports\n"
        "__all__, __getattr__, __dir__, _WHERE = lazy_exports(__name__, {'json': ('loads', 'sub')})\n")
    (tmp_path / "clashpkg" / "sub.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="clashpkg: exports named like its submodules"):
        importlib.import_module("clashpkg")
    assert "clashpkg" not in sys.modules
