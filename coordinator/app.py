"""The HTTP face of the coordinator: versioned REST under /v1, OpenAPI at /docs, a dashboard at /.

Every body is a pydantic model; every refusal is a 4xx with {"detail": "<reason>"}.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import json
import os
import tempfile
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs

from fastapi import FastAPI, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import (FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response,
                               StreamingResponse)
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.staticfiles import StaticFiles

from ravnest.spec import (FailureReport, HeartbeatRequest, HeartbeatResponse, JobSpec, JoinRequest, JoinResponse,
                          MetricsReport)

from .auth import COOKIE, Authentication, required
from .config import Settings
from .dashboard import ASSETS as DASHBOARD_ASSETS, render_dashboard, render_login
from .errors import CoordinatorError, TooLarge
from .limits import BodyLimit
from .jobs import TERMINAL
from .metrics import scrape
from .schemas import (CredentialCreated, CredentialView, CurvePoint, ErrorBody, Health, Identity, JobCreated,
                      JobSummary, JobView, JoinTokenRequest, KeyRequest, NodeView)
from .service import Coordinator, Principal

MAX_PROBE_BYTES = 64 << 20
DOCS_ASSETS = "/static/docs"
AUTH = Header(None, description="Bearer <token>: the join token for POST /v1/nodes, else the node token")
OCTET_STREAM_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary"}}}}}


LIMIT = Query(100, ge=1, le=1000, description="most items in this page")
OFFSET = Query(0, ge=0, le=1 << 31, description="items to skip (the page starts after them)")
DASHBOARD_ROWS = 200
KEEPALIVE_S = 15.0  # an event stream with nothing new sends a comment this often
MIN_EVENT_INTERVAL_S = 1.0  # a live view is sent at most this often, however often the store changes


def paged(response: Response, items: list, total: int) -> list:
    response.headers["X-Total-Count"] = str(total)
    return items


def _validation_reason(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        if item.get("type") == "json_invalid":  # loc is (body, character offset)
            offset = item.get("loc", ("body", "?"))[-1]
            parts.append(f"the body is not valid JSON (at character {offset}: {item.get('ctx', {}).get('error')})")
            continue
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return "; ".join(parts) or "invalid request"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    service = Coordinator(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async def reap_and_place() -> None:  # one pass per heartbeat interval: cheap, never busy
            while True:
                await asyncio.sleep(settings.heartbeat_interval_s)
                await run_in_threadpool(service.tick)

        task = asyncio.create_task(reap_and_place()) if settings.background else None
        try:
            yield
        finally:
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            service.store.close()

    app = FastAPI(title="Ravnest coordinator", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Takes volunteer nodes in, clusters them, plans jobs over them and tracks them. "
                              "Every call but /healthz needs a bearer token: an API key (operator, submitter or "
                              "reader), a join token, or a node's own credential (see coordinator/auth.py and "
                              "docs/security.md).")
    app.state.service = service
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)

    def routed(method: str, path: str) -> bool:
        return any(isinstance(route, APIRoute) and method in route.methods and route.path_regex.match(path)
                   for route in app.routes)

    app.add_middleware(Authentication, identify=service.identify, routed=routed)  # added last: runs first

    def principal(request: Request) -> Principal:
        return request.state.principal  # set by the Authentication gate

    def own_jobs(request: Request) -> str | None:
        """The key whose jobs alone this caller may see and act on; None: every job."""
        who = principal(request)
        return None if who.reads_every_job else who.id

    def acting_on(request: Request) -> str | None:
        """Cancelling, resuming, downloading: an operator acts on any job, a submitter on its own."""
        who = principal(request)
        return None if who.is_operator else who.id

    @app.exception_handler(CoordinatorError)
    async def coordinator_error(_: Request, error: CoordinatorError) -> JSONResponse:
        return JSONResponse({"detail": error.detail}, status_code=error.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = dict(error.headers or {})
        if error.status_code == 405:  # Starlette names only the first route's methods; a path may have several
            headers["Allow"] = ", ".join(sorted({method for route in app.routes if isinstance(route, APIRoute)
                                                 and route.path_regex.match(request.url.path)
                                                 for method in route.methods}))
        return JSONResponse({"detail": error.detail}, status_code=error.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _validation_reason(error)}, status_code=422)

    @app.get("/healthz", response_model=Health, tags=["service"])
    def healthz() -> Health:
        return service.health()

    @app.get("/v1/probe", tags=["nodes"], response_class=Response,
             responses={200: {"content": {"application/octet-stream": {}}, "description": "`bytes` zero bytes"}})
    def probe(size: int = Query(1 << 20, alias="bytes", ge=1, le=MAX_PROBE_BYTES)) -> Response:
        """Bytes for a node to time: how it measures its bandwidth to the coordinator when joining."""
        return Response(bytes(size), media_type="application/octet-stream")

    # the API docs work on an offline cluster: Swagger UI's and ReDoc's assets come from an installed package
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(importlib.resources.files("fastapi_offline") / "static")),
              name="docs-assets")
    app.mount(DASHBOARD_ASSETS, StaticFiles(directory=str(importlib.resources.files("coordinator") / "static")),
              name="dashboard-assets")

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Ravnest coordinator API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png")

    @app.get("/redoc", response_class=HTMLResponse, include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="Ravnest coordinator API",
                              redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{DOCS_ASSETS}/favicon.png", with_google_fonts=False)

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    def login_form() -> str:
        return render_login()

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        """An API key from the form becomes an HttpOnly cookie for the dashboard."""
        token = parse_qs((await request.body())[:4096].decode(errors="replace")).get("token", [""])[0].strip()
        who = await run_in_threadpool(service.identify, token) if token else "no key given"
        if isinstance(who, str) or who.kind != "key":
            return HTMLResponse(render_login(who if isinstance(who, str) else "that is not an API key"),
                                status_code=401)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.get("/logout", include_in_schema=False)
    def logout() -> Response:
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE)
        return response

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard(request: Request) -> str:
        return render_dashboard(service.list_nodes(DASHBOARD_ROWS)[0],
                                service.list_jobs(own_jobs(request), DASHBOARD_ROWS)[0])

    @app.get("/metrics", tags=["service"], response_class=PlainTextResponse,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    def prometheus_metrics(request: Request) -> Response:
        """Prometheus text format (coordinator/metrics.py): nodes, jobs and every active job's stages.
        Scrape it with an API key (`authorization: {credentials: <key>}` in the scrape config)."""
        return Response(scrape(service, own_jobs(request)), media_type=CONTENT_TYPE_LATEST)

    # --- nodes ---------------------------------------------------------------------------------------

    @app.post("/v1/nodes", response_model=JoinResponse, status_code=201, tags=["nodes"])
    def join(request: JoinRequest, authorization: str | None = AUTH) -> JoinResponse:
        return service.join(authorization, request)

    @app.post("/v1/nodes/{node_id}/heartbeat", response_model=HeartbeatResponse, tags=["nodes"])
    def heartbeat(node_id: str, request: HeartbeatRequest, authorization: str | None = AUTH) -> HeartbeatResponse:
        return service.heartbeat(node_id, authorization, request)

    @app.get("/v1/nodes", response_model=list[NodeView], tags=["nodes"])
    def list_nodes(response: Response, limit: int = LIMIT, offset: int = OFFSET) -> list[NodeView]:
        """A page of nodes in the order they joined; the header X-Total-Count says how many there are."""
        return paged(response, *service.list_nodes(limit, offset))

    @app.delete("/v1/nodes/{node_id}", status_code=204, tags=["nodes"])
    def leave(node_id: str, authorization: str | None = AUTH) -> Response:
        service.leave(node_id, authorization)
        return Response(status_code=204)

    @app.post("/v1/nodes/{node_id}/revoke", status_code=204, tags=["nodes"])
    def revoke_node(node_id: str) -> Response:
        """The node's credential stops working at once (its next call is refused); a job it held is
        re-planned without it."""
        service.revoke_node(node_id)
        return Response(status_code=204)

    # --- credentials (operator) ----------------------------------------------------------------------

    @app.get("/v1/whoami", response_model=Identity, tags=["credentials"])
    def whoami(request: Request) -> Identity:
        """The API key this call was made with: its role and what it may do."""
        who = principal(request)
        return Identity(id=who.id, role=who.role or "", name=who.name, sees_every_job=who.reads_every_job,
                        may_submit=who.role in ("submitter", "operator"))

    @app.post("/v1/join-tokens", response_model=CredentialCreated, status_code=201, tags=["credentials"])
    def create_join_token(body: JoinTokenRequest) -> CredentialCreated:
        """A token volunteers join with, maybe expiring and for a number of joins; shown only now."""
        return service.create_credential(body)

    @app.get("/v1/join-tokens", response_model=list[CredentialView], tags=["credentials"])
    def list_join_tokens(response: Response, limit: int = LIMIT, offset: int = OFFSET) -> list[CredentialView]:
        return paged(response, *service.list_credentials("join", limit, offset))

    @app.delete("/v1/join-tokens/{token_id}", status_code=204, tags=["credentials"])
    def revoke_join_token(token_id: str, request: Request) -> Response:
        """Nobody joins with it any more; nodes that joined with it stay (revoke them one by one)."""
        service.revoke_credential("join", token_id, principal(request))
        return Response(status_code=204)

    @app.post("/v1/keys", response_model=CredentialCreated, status_code=201, tags=["credentials"])
    def create_key(body: KeyRequest) -> CredentialCreated:
        """An API key with a role (operator, submitter, reader); shown only now."""
        return service.create_credential(body)

    @app.get("/v1/keys", response_model=list[CredentialView], tags=["credentials"])
    def list_keys(response: Response, limit: int = LIMIT, offset: int = OFFSET) -> list[CredentialView]:
        return paged(response, *service.list_credentials("key", limit, offset))

    @app.delete("/v1/keys/{key_id}", status_code=204, tags=["credentials"])
    def revoke_key(key_id: str, request: Request) -> Response:
        service.revoke_credential("key", key_id, principal(request))
        return Response(status_code=204)

    # --- jobs ----------------------------------------------------------------------------------------

    @app.post("/v1/jobs", response_model=JobCreated, status_code=201, tags=["jobs"])
    def submit(spec: JobSpec, request: Request) -> JobCreated:
        return service.submit(spec, owner=principal(request).id)

    @app.get("/v1/jobs", response_model=list[JobSummary], tags=["jobs"])
    def list_jobs(request: Request, response: Response, limit: int = LIMIT, offset: int = OFFSET) -> list[JobSummary]:
        """A page of jobs, oldest first: every job for operator and reader keys, a submitter's own for a
        submitter key. The header X-Total-Count says how many there are."""
        return paged(response, *service.list_jobs(own_jobs(request), limit, offset))

    @app.get("/v1/jobs/{job_id}", response_model=JobView, tags=["jobs"])
    def get_job(job_id: str, request: Request) -> JobView:
        return service.get_job(job_id, own_jobs(request))

    @app.get("/v1/jobs/{job_id}/curve", response_model=list[CurvePoint], tags=["jobs"])
    def curve(job_id: str, request: Request, after: int = Query(0, ge=0, le=1 << 62, description=(
            "only points with a larger id: the last id seen"))) -> list[CurvePoint]:
        """The job's training curve: each last stage's loss and, at evaluations, test accuracy, by step."""
        return service.curve(job_id, own_jobs(request), after)

    @app.get("/v1/jobs/{job_id}/events", tags=["jobs"], response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def events(job_id: str, request: Request) -> StreamingResponse:
        """Server-sent events: `job` (the job view) whenever it changes, at most once a second, and
        `curve` (new curve points); the stream ends after the job stops. What the dashboard draws."""
        owner = own_jobs(request)
        await run_in_threadpool(service.get_job, job_id, owner)  # 404 / 403 now, not inside the stream
        return StreamingResponse(_job_events(job_id, owner, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _job_events(job_id: str, owner: str | None, request: Request) -> AsyncIterator[str]:
        seen, sent, last_point = -1, "", 0
        while not await request.is_disconnected():
            version = await service.store.changes.wait(seen, KEEPALIVE_S)
            if version == seen:
                yield ": keep-alive\n\n"  # proxies and browsers keep an idle stream open
                continue
            seen = version
            view = await run_in_threadpool(service.get_job, job_id, owner)
            points = await run_in_threadpool(service.curve, job_id, owner, last_point)
            if points:
                last_point = points[-1].id
                yield "event: curve\ndata: " + json.dumps([p.model_dump() for p in points]) + "\n\n"
            body = view.model_dump_json()
            if body != sent:
                sent = body
                yield "event: job\ndata: " + body + "\n\n"
            if view.state in TERMINAL:
                return
            await asyncio.sleep(MIN_EVENT_INTERVAL_S)

    @app.post("/v1/jobs/{job_id}/cancel", response_model=JobView, tags=["jobs"])
    def cancel(job_id: str, request: Request) -> JobView:
        return service.cancel(job_id, acting_on(request))

    @app.post("/v1/jobs/{job_id}/resume", response_model=JobView, tags=["jobs"])
    def resume(job_id: str, request: Request) -> JobView:
        """Continue a failed or cancelled job from its last checkpoint, on the nodes there are now."""
        return service.resume(job_id, acting_on(request))

    @app.get("/v1/jobs/{job_id}/model", tags=["jobs"], response_class=FileResponse,
             responses={200: {"content": {"application/octet-stream": {}}, "description": "safetensors"}})
    def download_model(job_id: str, request: Request) -> FileResponse:
        return FileResponse(service.model_file(job_id, acting_on(request)), media_type="application/octet-stream",
                            filename=f"{job_id}.safetensors")

    # --- node-facing job endpoints -------------------------------------------------------------------

    @app.post("/v1/jobs/{job_id}/metrics", status_code=204, tags=["node reports"])
    def metrics(job_id: str, report: MetricsReport, authorization: str | None = AUTH) -> Response:
        service.report_metrics(job_id, authorization, report)
        return Response(status_code=204)

    @app.post("/v1/jobs/{job_id}/fail", status_code=204, tags=["node reports"])
    def fail(job_id: str, report: FailureReport, authorization: str | None = AUTH) -> Response:
        service.report_failure(job_id, authorization, report)
        return Response(status_code=204)

    async def receive(request: Request, job_id: str, limit: int) -> Path:
        """The request body streamed into a temporary file of the job's folder (never all in memory);
        the caller moves it away when accepted, else it is removed."""
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"upload of {declared} bytes exceeds this stage's limit of {limit} bytes")
        uploads = service.job_dir(job_id) / "uploads"
        uploads.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=uploads, suffix=".safetensors")
        path = Path(name)
        try:
            size = 0
            with os.fdopen(handle, "wb") as out:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise TooLarge(f"upload exceeds this stage's limit of {limit} bytes")
                    out.write(chunk)
        except BaseException:  # a sender that died mid-body leaves nothing behind
            path.unlink(missing_ok=True)
            raise
        return path

    @app.put("/v1/jobs/{job_id}/weights", status_code=204, tags=["node reports"], openapi_extra=OCTET_STREAM_BODY)
    async def upload_weights(job_id: str, request: Request, cluster: int = Query(ge=0), stage: int = Query(ge=0),
                             authorization: str | None = AUTH) -> Response:
        """Body: the stage's state dict as raw safetensors bytes, keys "{global block index}.<name>"."""
        limit = await run_in_threadpool(service.upload_limit, job_id, authorization, cluster, stage)
        path = await receive(request, job_id, limit)
        try:
            await run_in_threadpool(service.accept_weights, job_id, authorization, cluster, stage, path)
        finally:
            path.unlink(missing_ok=True)  # accepted uploads were moved away already
        return Response(status_code=204)

    @app.put("/v1/jobs/{job_id}/checkpoint", status_code=204, tags=["node reports"],
             openapi_extra=OCTET_STREAM_BODY)
    async def upload_checkpoint(job_id: str, request: Request, cluster: int = Query(ge=0), stage: int = Query(ge=0),
                                generation: int = Query(ge=0), step: int = Query(ge=0),
                                kind: Literal["periodic", "snapshot"] = Query("periodic"),
                                authorization: str | None = AUTH) -> Response:
        """Body: the stage's state at `step` as safetensors: its state dict plus optimizer state keyed
        "{parameter key}:{state name}". `snapshot`: handed in when the job is re-planned."""
        limit = await run_in_threadpool(service.upload_limit, job_id, authorization, cluster, stage, checkpoint=True)
        path = await receive(request, job_id, limit)
        try:
            await run_in_threadpool(service.accept_checkpoint, job_id, authorization, cluster, stage, generation,
                                    step, kind, path)
        finally:
            path.unlink(missing_ok=True)
        return Response(status_code=204)

    @app.get("/v1/jobs/{job_id}/state", tags=["node reports"], response_class=FileResponse,
             responses={200: {"content": {"application/octet-stream": {}}, "description": "safetensors"}})
    async def stage_state(job_id: str, cluster: int = Query(ge=0), stage: int = Query(ge=0),
                          authorization: str | None = AUTH) -> FileResponse:
        """The state a re-planned stage continues from: its blocks' parameters and optimizer state."""
        outgoing = service.job_dir(job_id) / "outgoing"
        outgoing.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=outgoing, suffix=".safetensors")
        os.close(handle)
        path = Path(name)
        try:
            await run_in_threadpool(service.stage_state, job_id, authorization, cluster, stage, path)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return FileResponse(path, media_type="application/octet-stream", background=BackgroundTask(path.unlink))

    document_refusals(app)
    return app


def document_refusals(app: FastAPI) -> None:
    """Every refusal an endpoint can answer, in the OpenAPI document, with the body it has:
    {"detail": "<reason>"}, also for 422 (instead of FastAPI's default list of errors)."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = generate()
        document["components"]["schemas"]["ErrorBody"] = ErrorBody.model_json_schema()
        body = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                statuses = {422} if operation.get("parameters") or "requestBody" in operation else set()
                if "requestBody" in operation:
                    statuses |= {400}  # not even JSON
                if required(method.upper(), path) != "open":
                    statuses |= {401, 403}
                if "{" in path:
                    statuses |= {404}
                if method != "get":
                    statuses |= {409, 413}  # a state that does not allow it; a body over the limit
                for status in sorted(statuses):
                    operation["responses"][str(status)] = {"description": HTTPStatus(status).phrase, **body}
        document["components"]["schemas"].pop("HTTPValidationError", None)
        document["components"]["schemas"].pop("ValidationError", None)
        app.openapi_schema = document
        return document

    app.openapi = openapi
