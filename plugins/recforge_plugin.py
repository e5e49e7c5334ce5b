"""RecForge's Airflow plugin: the RecForge page (read-only, behind Airflow's login) at /recforge, in the navigation.

The app itself lives in recforge.ui; this file only registers it. It is built on the api-server's first request
to /recforge, so the other Airflow processes that import plugins (scheduler, task processes) stay light.
"""
from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from recforge.ui.airflow_app import LazyApp

URL_PREFIX = "/recforge"


class RecForgePlugin(AirflowPlugin):
    name = "recforge"
    fastapi_apps = [{"app": LazyApp(), "url_prefix": URL_PREFIX, "name": "RecForge"}]
    # url_route: the page opens inside Airflow's UI (an iframe at /plugin/recforge); href is relative to base_url
    external_views = [{
        "name": "RecForge",
        "href": URL_PREFIX.lstrip("/") + "/",
        "url_route": "recforge",
        "destination": "nav",
        "nav_top_level": True,
    }]
