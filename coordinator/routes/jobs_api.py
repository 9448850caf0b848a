"""Jobs as people see them: submit, list, follow (curve, live events), cancel, resume, download."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response, StreamingResponse

from ravnest.spec import JobSpec

from ..jobs import TERMINAL
from ..schemas import CurvePoint, JobCreated, JobSummary, JobView
from ..service import Coordinator
from . import LIMIT, OFFSET, acting_on, own_jobs, paged, principal, service

KEEPALIVE_S = 15.0  # an event stream with nothing new sends a comment this often
MIN_EVENT_INTERVAL_S = 1.0  # a live view is sent at most this often, however often the store changes
router = APIRouter(tags=["jobs"])


@router.post("/v1/jobs", response_model=JobCreated, status_code=201)
def submit(spec: JobSpec, request: Request) -> JobCreated:
    return service(request).jobs.submit(spec, owner=principal(request).id)


@router.get("/v1/jobs", response_model=list[JobSummary])
def list_jobs(request: Request, response: Response, limit: int = LIMIT, offset: int = OFFSET) -> list[JobSummary]:
    """A page of jobs, oldest first: every job for operator and reader keys, a submitter's own for a
    submitter key. The header X-Total-Count says how many there are."""
    return paged(response, *service(request).jobs.list_jobs(own_jobs(request), limit, offset))


@router.get("/v1/jobs/{job_id}", response_model=JobView)
def get_job(job_id: str, request: Request) -> JobView:
    return service(request).jobs.get_job(job_id, own_jobs(request))


@router.get("/v1/jobs/{job_id}/curve", response_model=list[CurvePoint])
def curve(job_id: str, request: Request, after: int = Query(0, ge=0, le=1 << 62, description=(
        "only points with a larger id: the last id seen"))) -> list[CurvePoint]:
    """The job's training curve: each last stage's loss and, at evaluations, test accuracy, by step."""
    return service(request).jobs.curve(job_id, own_jobs(request), after)


@router.get("/v1/jobs/{job_id}/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}}})
async def events(job_id: str, request: Request) -> StreamingResponse:
    """Server-sent events: `job` (the job view) whenever it changes, at most once a second, and
    `curve` (new curve points); the stream ends after the job stops. What the dashboard draws."""
    owner, coordinator = own_jobs(request), service(request)
    await run_in_threadpool(coordinator.jobs.get_job, job_id, owner)  # 404 / 403 now, not inside the stream
    return StreamingResponse(_job_events(coordinator, job_id, owner, request), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _job_events(coordinator: Coordinator, job_id: str, owner: str | None,
                      request: Request) -> AsyncIterator[str]:
    seen, sent, last_point = -1, "", 0
    while not await request.is_disconnected():
        version = await coordinator.store.changes.wait(seen, KEEPALIVE_S)
        if version == seen:
            yield ": keep-alive\n\n"  # proxies and browsers keep an idle stream open
            continue
        seen = version
        view = await run_in_threadpool(coordinator.jobs.get_job, job_id, owner)
        points = await run_in_threadpool(coordinator.jobs.curve, job_id, owner, last_point)
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


@router.post("/v1/jobs/{job_id}/cancel", response_model=JobView)
def cancel(job_id: str, request: Request) -> JobView:
    return service(request).jobs.cancel(job_id, acting_on(request))


@router.post("/v1/jobs/{job_id}/resume", response_model=JobView)
def resume(job_id: str, request: Request) -> JobView:
    """Continue a failed or cancelled job from its last checkpoint, on the nodes there are now."""
    return service(request).jobs.resume(job_id, acting_on(request))


@router.get("/v1/jobs/{job_id}/model", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {}, "application/zip": {}},
                             "description": "safetensors; with format=hf a zip of a Hugging Face folder"}})
def download_model(job_id: str, request: Request, format: Literal["ravnest", "hf"] = "ravnest") -> FileResponse:
    """The trained model: one safetensors file (`ravnest.load_model`), or with format=hf (llama models)
    a zip of the folder `transformers.AutoModelForCausalLM.from_pretrained` loads, with the job's
    tokenizer where it recorded one."""
    artifacts = service(request).artifacts
    if format == "hf":
        return FileResponse(artifacts.hf_folder(job_id, acting_on(request)), media_type="application/zip",
                            filename=f"{job_id}-hf.zip")
    return FileResponse(artifacts.model_file(job_id, acting_on(request)),
                        media_type="application/octet-stream", filename=f"{job_id}.safetensors")
