"""The pinned environment logged with a model."""
from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version


def pinned_requirements(packages: Iterable[str]) -> list[str]:
    """`pkg==version` for each installed package (local version labels dropped); MLflow's own inference of
    the environment takes seconds per model."""
    out = []
    for pkg in packages:
        try:
            out.append(f"{pkg}=={version(pkg).split('+')[0]}")
        except PackageNotFoundError:
            pass
    return out
