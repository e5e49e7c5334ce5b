"""Where the embedded defaults keep their state: $RECFORGE_HOME, else <repo>/.recforge."""
from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    # platform/recforge/tracking/paths.py -> repo root is three levels above `recforge`.
    return Path(__file__).resolve().parents[3]


def recforge_home() -> Path:
    env = os.environ.get("RECFORGE_HOME")
    return Path(env).resolve() if env else repo_root() / ".recforge"
