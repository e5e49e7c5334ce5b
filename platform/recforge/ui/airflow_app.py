"""The RecForge app as the Airflow api-server mounts it, behind Airflow's own authentication.

Airflow does not authenticate plugin FastAPI apps (a mounted app inherits none of the core API's dependencies),
so every route here depends on Airflow's `requires_access_dag`: it resolves the caller from the
`Authorization: Bearer <JWT>` header or the UI's `_token` cookie through the configured auth manager (401
without a credential, 403 for an invalid one) and then asks the auth manager whether that user may read the
runs of `recforge_daily` (403 otherwise). Only the api-server builds the app (LazyApp).
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import FastAPI

DAG_ID = "recforge_daily"


def airflow_auth_dependency() -> Any:
    # Airflow's API security stack: the plugin module loads in every Airflow process, only the api-server needs it
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity  # lazy: see above
    from airflow.api_fastapi.core_api.security import requires_access_dag  # lazy: see above

    return requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=DAG_ID)


def airflow_base_url() -> str:
    from airflow.configuration import conf  # lazy: read when the api-server builds the app, not at plugin load

    return (conf.get("api", "base_url", fallback="") or "/").rstrip("/") + "/"


def create_airflow_app() -> FastAPI:
    from recforge.ui.app import create_app  # lazy: FastAPI + the page's data layer, built on the first request

    return create_app(auth=airflow_auth_dependency(), airflow_url=airflow_base_url())


class LazyApp:
    """An ASGI app that builds the real one on its first request.

    Airflow imports plugin modules in every process that loads plugins, task processes included; building the
    FastAPI app (Airflow's API security module, the UI's data layer, MLflow) only when the api-server serves
    the first request keeps those imports cheap.
    """

    def __init__(self) -> None:
        self._app: FastAPI | None = None
        self._lock: asyncio.Lock | None = None

    async def __call__(self, scope, receive, send) -> None:
        if self._app is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                if self._app is None:
                    # seconds of imports (MLflow): off the event loop, so Airflow's own pages stay responsive
                    self._app = await asyncio.to_thread(create_airflow_app)
        await self._app(scope, receive, send)
