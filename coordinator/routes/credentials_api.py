"""API keys and join tokens (operator only, coordinator/auth.py), and who a caller is."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..schemas import CredentialCreated, CredentialView, Identity, JoinTokenRequest, KeyRequest
from . import LIMIT, OFFSET, paged, principal, service

router = APIRouter(tags=["credentials"])


@router.get("/v1/whoami", response_model=Identity)
def whoami(request: Request) -> Identity:
    """The API key this call was made with: its role and what it may do."""
    who = principal(request)
    return Identity(id=who.id, role=who.role or "", name=who.name, sees_every_job=who.reads_every_job,
                    may_submit=who.role in ("submitter", "operator"))


@router.post("/v1/join-tokens", response_model=CredentialCreated, status_code=201)
def create_join_token(request: Request, body: JoinTokenRequest) -> CredentialCreated:
    """A token volunteers join with, maybe expiring and for a number of joins; shown only now."""
    return service(request).credentials.create_credential(body)


@router.get("/v1/join-tokens", response_model=list[CredentialView])
def list_join_tokens(request: Request, response: Response, limit: int = LIMIT,
                     offset: int = OFFSET) -> list[CredentialView]:
    return paged(response, *service(request).credentials.list_credentials("join", limit, offset))


@router.delete("/v1/join-tokens/{token_id}", status_code=204)
def revoke_join_token(token_id: str, request: Request) -> Response:
    """Nobody joins with it any more; nodes that joined with it stay (revoke them one by one)."""
    service(request).credentials.revoke_credential("join", token_id, principal(request))
    return Response(status_code=204)


@router.post("/v1/keys", response_model=CredentialCreated, status_code=201)
def create_key(request: Request, body: KeyRequest) -> CredentialCreated:
    """An API key with a role (operator, submitter, reader); shown only now."""
    return service(request).credentials.create_credential(body)


@router.get("/v1/keys", response_model=list[CredentialView])
def list_keys(request: Request, response: Response, limit: int = LIMIT, offset: int = OFFSET) -> list[CredentialView]:
    return paged(response, *service(request).credentials.list_credentials("key", limit, offset))


@router.delete("/v1/keys/{key_id}", status_code=204)
def revoke_key(key_id: str, request: Request) -> Response:
    service(request).credentials.revoke_credential("key", key_id, principal(request))
    return Response(status_code=204)
