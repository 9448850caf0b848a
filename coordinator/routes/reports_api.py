"""What a node sends and fetches while it trains a job: metrics, failures, weights and checkpoints (as
safetensors bodies streamed to disk, never all in memory), and the state a re-planned stage continues
from."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response
from starlette.background import BackgroundTask

from ravnest.spec import FailureReport, MetricsReport

from ..service_errors import TooLarge
from ..service import Coordinator
from . import AUTH, service

OCTET_STREAM_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {
    "schema": {"type": "string", "format": "binary"}}}}}
SAFETENSORS: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "safetensors"}}
router = APIRouter(tags=["node reports"])


@router.post("/v1/jobs/{job_id}/metrics", status_code=204)
def metrics(request: Request, job_id: str, report: MetricsReport, authorization: str | None = AUTH) -> Response:
    service(request).jobs.report_metrics(job_id, authorization, report)
    return Response(status_code=204)


@router.post("/v1/jobs/{job_id}/fail", status_code=204)
def fail(request: Request, job_id: str, report: FailureReport, authorization: str | None = AUTH) -> Response:
    service(request).jobs.report_failure(job_id, authorization, report)
    return Response(status_code=204)


async def receive(coordinator: Coordinator, request: Request, job_id: str, limit: int) -> Path:
    """The request body streamed into a temporary file of the job's folder (never all in memory);
    the caller moves it away when accepted, else it is removed."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"upload of {declared} bytes exceeds this stage's limit of {limit} bytes")
    uploads = coordinator.artifacts.job_dir(job_id) / "uploads"
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


@router.put("/v1/jobs/{job_id}/weights", status_code=204, openapi_extra=OCTET_STREAM_BODY)
async def upload_weights(job_id: str, request: Request, cluster: int = Query(ge=0), stage: int = Query(ge=0),
                         authorization: str | None = AUTH) -> Response:
    """Body: the stage's state dict as raw safetensors bytes, keys "{global block index}.<name>"."""
    coordinator = service(request)
    limit = await run_in_threadpool(coordinator.artifacts.upload_limit, job_id, authorization, cluster, stage)
    path = await receive(coordinator, request, job_id, limit)
    try:
        await run_in_threadpool(coordinator.jobs.hand_in_weights, job_id, authorization, cluster, stage, path)
    finally:
        path.unlink(missing_ok=True)  # accepted uploads were moved away already
    return Response(status_code=204)


@router.put("/v1/jobs/{job_id}/checkpoint", status_code=204, openapi_extra=OCTET_STREAM_BODY)
async def upload_checkpoint(job_id: str, request: Request, cluster: int = Query(ge=0), stage: int = Query(ge=0),
                            generation: int = Query(ge=0), step: int = Query(ge=0),
                            kind: Literal["periodic", "snapshot"] = Query("periodic"),
                            authorization: str | None = AUTH) -> Response:
    """Body: the stage's state at `step` as safetensors: its state dict plus optimizer state keyed
    "{parameter key}:{state name}". `snapshot`: handed in when the job is re-planned."""
    coordinator = service(request)
    artifacts = coordinator.artifacts
    limit = await run_in_threadpool(artifacts.upload_limit, job_id, authorization, cluster, stage, checkpoint=True)
    path = await receive(coordinator, request, job_id, limit)
    try:
        await run_in_threadpool(artifacts.accept_checkpoint, job_id, authorization, cluster, stage, generation,
                                step, kind, path)
    finally:
        path.unlink(missing_ok=True)
    return Response(status_code=204)


@router.get("/v1/jobs/{job_id}/state", response_class=FileResponse, responses=SAFETENSORS)
async def stage_state(job_id: str, request: Request, cluster: int = Query(ge=0), stage: int = Query(ge=0),
                      authorization: str | None = AUTH) -> FileResponse:
    """The state a re-planned stage continues from: its blocks' parameters and optimizer state."""
    path = await run_in_threadpool(service(request).artifacts.stage_state, job_id, authorization, cluster, stage)
    return FileResponse(path, media_type="application/octet-stream", background=BackgroundTask(path.unlink))
