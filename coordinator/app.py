"""The HTTP face of the coordinator: versioned REST under /v1, OpenAPI at /docs, a dashboard at /.

Every body is a pydantic model; every refusal is a 4xx with {"detail": "<reason>"}. The routes live
by concern in coordinator/routes/; this puts them together with the gates they pass first (quiet
heartbeats' own door, then authentication, then the body limit) and the one shape refusals have.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ravnest.errors import did_you_mean
from ravnest.pipeline.memory import trim_heap
from ravnest.spec import JobSpec, field_names

from .auth import Authentication, required
from .config import Settings
from .service_errors import CoordinatorError
from .limits import BodyLimit
from .quiet_beats import QuietBeats
from .routes import credentials_api, jobs_api, nodes_api, reports_api, site
from .schemas import ErrorBody
from .service import Coordinator
from .service.presence import FLUSH_S


def _validation_reason(error: RequestValidationError, body: type[BaseModel] | None = None) -> str:
    """One line for a refused body; with `body` (the model it was read as) a mistyped field gets a
    "did you mean"."""
    parts = []
    for item in error.errors():
        if item.get("type") == "json_invalid":  # loc is (body, character offset)
            offset = item.get("loc", ("body", "?"))[-1]
            parts.append(f"the body is not valid JSON (at character {offset}: {item.get('ctx', {}).get('error')})")
            continue
        loc = [p for p in item.get("loc", ()) if p != "body"]
        where = ".".join(str(p) for p in loc)
        hint = ""
        if item.get("type") == "extra_forbidden" and body is not None and loc and isinstance(loc[-1], str):
            hint = did_you_mean(loc[-1], field_names(body, loc[:-1]))
        message = str(item.get("msg")).removeprefix("Value error, ")  # pydantic's prefix to our own words
        parts.append(f"{where}: {message}{hint}" if where else message)
    return "; ".join(parts) or "invalid request"


METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE")
log = logging.getLogger(__name__)
THREADS = 16  # requests served at once (their handlers are synchronous: see lifespan)


def _routed(app: FastAPI, method: str, path: str) -> bool:
    """Whether an endpoint answers `method` on `path` (included routers too), asked the way Starlette
    routes a request; unknown paths and methods get their 404 or 405 without a credential."""
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    return any(route.matches(scope)[0] == Match.FULL for route in app.routes)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    service = Coordinator(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # fewer threads than AnyIO's 40: on a few cores more of them only queue for the GIL, each
        # request's wait growing with their number (and each wants a database connection)
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        # what start-up made (torch, the models' code, the web stack: ~300,000 objects) is never
        # scanned by the garbage collector again: each full collection stopped every thread for
        # 130-290 ms, and at a thousand nodes that alone put the heartbeats' p99 past 250 ms
        gc.freeze()
        async def every(seconds: float, *work: Callable[[], None]) -> None:
            """`work` in the thread pool every `seconds`; a pass that fails is logged, and the next one
            runs (a database that went away for a moment must not end the liveness tick for good)."""
            while True:
                await asyncio.sleep(seconds)
                for one in work:
                    try:
                        await run_in_threadpool(one)
                    except Exception:
                        log.exception("the coordinator's background work failed (it runs again in %.1f s)",
                                      seconds)

        # the tick: one pass per heartbeat interval, cheap, never busy; and every FLUSH_S the
        # heartbeats' sightings and what dial-backs found, and placements asked for since
        # (and what a burst of requests left on the C heap goes back to the system: uvicorn buffers up
        # to 64 KiB of each request's body, 30 MiB for 200 callers that never finish theirs)
        tasks = [asyncio.create_task(every(settings.heartbeat_interval_s, service.tick, trim_heap)),
                 asyncio.create_task(every(min(settings.placement_debounce_s, FLUSH_S),
                                           service.membership.presence.flush, service.membership.reachability.flush,
                                           service.placement.place_if_asked))
                 ] if settings.background else []

        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            service.membership.presence.flush()
            service.membership.reachability.flush()
            service.close()

    app = FastAPI(title="Ravnest coordinator", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Takes volunteer nodes in, clusters them, plans jobs over them and tracks them. "
                              "Every call but /healthz needs a bearer token: an API key (operator, submitter or "
                              "reader), a join token, or a node's own credential (see coordinator/auth.py and "
                              "docs/security.md).")
    app.state.service = service
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes, grace_s=settings.body_grace_s)

    app.add_middleware(Authentication, identify=service.credentials.identify,
                       routed=lambda method, path: _routed(app, method, path))
    presence = service.membership.presence
    app.add_middleware(QuietBeats, answer=presence.answer_raw, known=presence.known,  # added last: runs first
                       vouched=presence.vouched, max_bytes=settings.max_request_bytes, grace_s=settings.body_grace_s)
    _answer_refusals(app)
    site.mount_assets(app)
    for routes in (site, nodes_api, credentials_api, jobs_api, reports_api):
        app.include_router(routes.router)
    document_refusals(app)
    return app


def _answer_refusals(app: FastAPI) -> None:
    """Every refusal is {"detail": "<reason>"} with its status, whatever raised it."""
    @app.exception_handler(CoordinatorError)
    async def coordinator_error(_: Request, error: CoordinatorError) -> JSONResponse:
        return JSONResponse({"detail": error.detail}, status_code=error.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        headers = dict(error.headers or {})
        if error.status_code == 405:  # Starlette names only the first route's methods; a path may have several
            headers["Allow"] = ", ".join(sorted(m for m in METHODS if _routed(app, m, request.url.path)))
        return JSONResponse({"detail": error.detail}, status_code=error.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        submitted = request.method == "POST" and request.url.path == "/v1/jobs"  # (a job spec)
        return JSONResponse({"detail": _validation_reason(error, JobSpec if submitted else None)}, status_code=422)


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

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the document
