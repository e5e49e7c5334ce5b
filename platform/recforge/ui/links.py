"""Links into the MLflow UI: base URL from RECFORGE_MLFLOW_URL (default http://127.0.0.1:5000)."""
from __future__ import annotations

import os
from urllib.parse import quote, urlsplit

DEFAULT_MLFLOW_URL = "http://127.0.0.1:5000"


def mlflow_base(value: str | None = None) -> str:
    """The MLflow UI's base URL; only http(s) URLs are accepted (a link is rendered into every page)."""
    url = (value if value is not None else os.environ.get("RECFORGE_MLFLOW_URL") or DEFAULT_MLFLOW_URL).strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"RECFORGE_MLFLOW_URL must be an http(s) URL, got {url!r}")
    return url.rstrip("/")


class MlflowLinks:
    def __init__(self, base: str):
        self.base = base

    def experiment(self, experiment_id: str | None) -> str | None:
        return f"{self.base}/#/experiments/{quote(experiment_id, safe='')}" if experiment_id else None

    def run(self, experiment_id: str | None, run_id: str | None) -> str | None:
        if not (experiment_id and run_id):
            return None
        return f"{self.base}/#/experiments/{quote(experiment_id, safe='')}/runs/{quote(run_id, safe='')}"

    def model_version(self, name: str | None, version: str | int | None) -> str | None:
        if not name or version in (None, ""):
            return None
        return f"{self.base}/#/models/{quote(name, safe='')}/versions/{quote(str(version), safe='')}"
