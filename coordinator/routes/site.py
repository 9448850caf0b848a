"""What is not the versioned API's resources: health, the bandwidth probe, the API docs (offline),
the dashboard's login and page, and Prometheus' scrape."""
from __future__ import annotations

import importlib.resources
import time
from collections.abc import AsyncIterator
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.staticfiles import StaticFiles

from ..auth import COOKIE
from ..dashboard import ASSETS as DASHBOARD_ASSETS, render_dashboard, render_login
from ..metrics import scrape
from ..login_links import LINK_S, LoginLinks
from ..schemas import DashboardLink, Health
from ..service_errors import TooMany
from ..limits import ProbeSlots
from . import own_jobs, principal, service

MAX_PROBE_BYTES = 64 << 20
PROBE_CHUNK = bytes(64 << 10)  # every probe sends this one buffer, as often as it takes
PROBES_PER_CREDENTIAL = 4  # (nodes joining together share the join token; each probes for a second or two)
PROBE_SLOT_S = 120.0  # a probe slot is freed after this even if its probe never ended
DOCS_ASSETS = "/static/docs"
DASHBOARD_ROWS = 200
router = APIRouter()


def mount_assets(app: FastAPI) -> None:
    """The API docs work on an offline cluster: Swagger UI's and ReDoc's assets come from an installed
    package; the dashboard's from ours. (And the probes' slots and the one-time login links, per app.)"""
    app.state.probe_slots = ProbeSlots(PROBES_PER_CREDENTIAL, PROBE_SLOT_S)
    app.state.login_links = LoginLinks(app.state.service.store, time.time)
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(importlib.resources.files("fastapi_offline") / "static")),
              name="docs-assets")
    app.mount(DASHBOARD_ASSETS, StaticFiles(directory=str(importlib.resources.files("coordinator") / "static")),
              name="dashboard-assets")


@router.get("/healthz", response_model=Health, tags=["service"])
def healthz(request: Request) -> Health:
    return service(request).membership.presence.health()


@router.get("/v1/probe", tags=["nodes"], response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}, "description": "`bytes` zero bytes"}})
async def probe(request: Request, size: int = Query(1 << 20, alias="bytes", ge=1, le=MAX_PROBE_BYTES)) -> Response:
    """Bytes for a node to time: how it measures its bandwidth to the coordinator when joining. At most
    PROBES_PER_CREDENTIAL at once per credential (429 beyond)."""
    who, slots = principal(request).id, request.app.state.probe_slots
    if not slots.take(who):
        raise TooMany(f"{PROBES_PER_CREDENTIAL} probes of this credential are open already; retry in a second")

    async def zeros() -> AsyncIterator[bytes]:
        try:
            for start in range(0, size, len(PROBE_CHUNK)):
                yield PROBE_CHUNK[:size - start] if size - start < len(PROBE_CHUNK) else PROBE_CHUNK
        finally:
            slots.release(who)

    return StreamingResponse(zeros(), media_type="application/octet-stream", headers={"content-length": str(size)})


@router.get("/docs", response_class=HTMLResponse, include_in_schema=False)
def docs() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="Ravnest coordinator API",
                               swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                               swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                               swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png")


@router.get("/redoc", response_class=HTMLResponse, include_in_schema=False)
def redoc() -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title="Ravnest coordinator API",
                          redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
                          redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png", with_google_fonts=False)


@router.get("/login", response_class=HTMLResponse, include_in_schema=False)
def login_form(request: Request, once: str = Query("", max_length=64)) -> Response:
    """The login form; with `once`, a one-time link (`ravnest dashboard`) that logs in at once."""
    if not once:
        return HTMLResponse(render_login())
    key = request.app.state.login_links.redeem(once)
    if key is None:
        return HTMLResponse(render_login(f"that link was used already or is over {LINK_S:.0f} s old: run "
                                         f"`ravnest dashboard` again, or log in with your key"), status_code=401)
    return _logged_in(key)


@router.post("/v1/dashboard-link", response_model=DashboardLink, tags=["service"])
def dashboard_link(request: Request) -> DashboardLink:
    """A link that opens the dashboard once, logged in with the caller's key, for LINK_S seconds. The
    key never appears in it (`ravnest dashboard`)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else request.cookies.get(COOKIE, "")
    code = request.app.state.login_links.create(key)
    return DashboardLink(path=f"/login?once={code}", expires_in_s=LINK_S)


@router.post("/login", include_in_schema=False)
async def login(request: Request) -> Response:
    """An API key from the form becomes an HttpOnly cookie for the dashboard."""
    token = parse_qs((await request.body())[:4096].decode(errors="replace")).get("token", [""])[0].strip()
    who = await run_in_threadpool(service(request).credentials.identify, token) if token else "no key given"
    if isinstance(who, str) or who.kind != "key":
        return HTMLResponse(render_login(who if isinstance(who, str) else "that is not an API key"), status_code=401)
    return _logged_in(token)


def _logged_in(key: str) -> Response:
    """To the dashboard, with the key as an HttpOnly cookie (what every dashboard call then sends)."""
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(COOKIE, key, httponly=True, samesite="strict")
    return response


@router.get("/logout", include_in_schema=False)
def logout() -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE)
    return response


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def dashboard(request: Request) -> str:
    coordinator = service(request)
    return render_dashboard(coordinator.membership.list_nodes(DASHBOARD_ROWS),
                            coordinator.jobs.list_jobs(own_jobs(request), DASHBOARD_ROWS))


@router.get("/metrics", tags=["service"], response_class=PlainTextResponse,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def prometheus_metrics(request: Request) -> Response:
    """Prometheus text format (coordinator/metrics.py): nodes, jobs and every active job's stages.
    Scrape it with an API key (`authorization: {credentials: <key>}` in the scrape config)."""
    coordinator = service(request)
    return Response(scrape(coordinator.membership, coordinator.jobs, own_jobs(request)), media_type=CONTENT_TYPE_LATEST)
