"""Volunteers join, heartbeat and leave; operators list and revoke them."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ravnest.spec import HeartbeatRequest, HeartbeatResponse, JoinRequest, JoinResponse, Offered

from ..schemas import NodeView
from . import AUTH, LIMIT, OFFSET, paged, service

router = APIRouter(tags=["nodes"])


@router.post("/v1/nodes", response_model=JoinResponse, status_code=201)
def join(request: Request, body: JoinRequest, authorization: str | None = AUTH) -> JoinResponse:
    return service(request).membership.join(authorization, body)


@router.post("/v1/nodes/{node_id}/heartbeat", response_model=HeartbeatResponse)
def heartbeat(request: Request, node_id: str, body: HeartbeatRequest,
              authorization: str | None = AUTH) -> HeartbeatResponse:
    return service(request).membership.heartbeat(node_id, authorization, body)


@router.put("/v1/nodes/{node_id}/offers", status_code=204)
def offer(request: Request, node_id: str, body: Offered, authorization: str | None = AUTH) -> Response:
    """The files this node offers from now on (it keeps its id): each must be proven again, as at join."""
    service(request).membership.offer(node_id, authorization, body)
    return Response(status_code=204)


@router.get("/v1/nodes", response_model=list[NodeView])
def list_nodes(request: Request, response: Response, limit: int = LIMIT, offset: int = OFFSET,
               state: Literal["idle", "busy", "gone"] | None = Query(None, description="only nodes in this state"),
               name: str | None = Query(None, max_length=128, description="only nodes whose name holds this text "
                                                                           "(in any case)")) -> list[NodeView]:
    """A page of nodes in the order they joined; the header X-Total-Count says how many there are (of
    those `state` and `name` select)."""
    return paged(response, *service(request).membership.list_nodes(limit, offset, state, name))


@router.delete("/v1/nodes/{node_id}", status_code=204)
def leave(request: Request, node_id: str, authorization: str | None = AUTH) -> Response:
    service(request).membership.leave(node_id, authorization)
    return Response(status_code=204)


@router.post("/v1/nodes/{node_id}/revoke", status_code=204)
def revoke_node(request: Request, node_id: str) -> Response:
    """The node's credential stops working at once (its next call is refused); a job it held is
    re-planned without it."""
    service(request).membership.revoke_node(node_id)
    return Response(status_code=204)
