"""The RecForge page as a FastAPI app: HTML for people, the same data as JSON for scripts. Read-only (GET only).

`create_app(auth=...)` takes the authentication dependency: the Airflow plugin passes Airflow's own
(recforge.ui.airflow_app); without one the app refuses to start unless `allow_anonymous=True` (tests only).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from recforge.ui.links import MlflowLinks, mlflow_base
from recforge.ui.mlflow_view import MlflowView
from recforge.ui.runs import RunNotFound, list_runs, load_run, runs_root
from recforge.ui.view import run_detail, run_summary

TEMPLATES = Path(__file__).with_name("templates")
# no scripts at all; styles and images inline; the page may only be framed by Airflow's own origin
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                               "frame-ancestors 'self'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def templates() -> Environment:
    # autoescape=True for every template, whatever its file name: everything rendered is escaped
    return Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=True, undefined=StrictUndefined,
                       trim_blocks=True, lstrip_blocks=True)


def create_app(auth: Callable[..., Any] | None = None, *, allow_anonymous: bool = False,
               home: Path | None = None, tracking_uri: str | None = None, mlflow_url: str | None = None,
               airflow_url: str = "/") -> FastAPI:
    if auth is None and not allow_anonymous:
        raise ValueError("create_app needs an authentication dependency (or allow_anonymous=True for tests)")
    env = templates()
    links = MlflowLinks(mlflow_base(mlflow_url))
    app = FastAPI(title="RecForge", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(auth)] if auth is not None else [])

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        if request.method not in ("GET", "HEAD"):
            return JSONResponse({"detail": "the RecForge page is read-only"}, status_code=405,
                                headers={"Allow": "GET, HEAD", **SECURITY_HEADERS})
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    def root() -> Path:
        return runs_root(home)

    def overview() -> dict[str, Any]:
        ml = MlflowView(tracking_uri)
        parents = ml.pipeline_runs()
        unfinished = ml.unfinished_runs()  # failed or running stage runs: a failed run vs one in progress
        exp = ml.experiment_id()
        rows = []
        for r in list_runs(root()):
            mlruns = dict(unfinished.get(r.run_key, {}))
            if r.run_key in parents:
                mlruns["pipeline"] = parents[r.run_key]
            rows.append(run_summary(r, mlruns, links, exp))
        return {"runs": rows, "experiment_url": links.experiment(exp), "problems": ml.problems,
                "runs_dir": str(root())}

    def detail(run_key: str) -> dict[str, Any]:
        try:
            run = load_run(root(), run_key)
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from None
        except RunNotFound:
            raise HTTPException(status_code=404, detail=f"no pipeline run {run_key!r}") from None
        return run_detail(run, MlflowView(tracking_uri), links)

    def page(request: Request, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        index_url = str(request.scope.get("root_path", "")).rstrip("/") + "/"  # where this app is mounted
        html = env.get_template(name).render(airflow_url=airflow_url, mlflow_url=links.base, index_url=index_url,
                                             **context)
        return HTMLResponse(html, status_code=status)

    # sync handlers: FastAPI runs them in a thread pool, so file and MLflow reads do not block the event loop
    @app.get("/", response_class=HTMLResponse)
    def index_page(request: Request) -> HTMLResponse:
        return page(request, "index.html", **overview())

    @app.get("/runs/{run_key}", response_class=HTMLResponse)
    def run_page(request: Request, run_key: str) -> HTMLResponse:
        return page(request, "run.html", run=detail(run_key))

    @app.get("/api/runs")
    def runs_json() -> dict[str, Any]:
        return overview()

    @app.get("/api/runs/{run_key}")
    def run_json(run_key: str) -> dict[str, Any]:
        return detail(run_key)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        wants_html = "text/html" in request.headers.get("accept", "") and "/api/" not in request.url.path
        response: HTMLResponse | JSONResponse
        if wants_html:
            response = page(request, "error.html", status=exc.status_code, code=exc.status_code,
                            detail=str(exc.detail))
        else:
            response = JSONResponse({"detail": exc.detail}, status_code=exc.status_code)
        response.headers.update(exc.headers or {})
        return response

    return app
