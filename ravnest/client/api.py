"""The one client of the coordinator's REST API, for the `ravnest` command and the node alike: every
refusal becomes one ApiError with the coordinator's reason and status (0: it could not be reached)."""
from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any

import httpx

from ravnest.errors import RavnestError

log = logging.getLogger(__name__)
CONNECT_S = 5.0  # how long a connection may take before the next coordinator is tried
GATEWAY_ERRORS = (502, 503, 504)  # a proxy or load balancer found no coordinator behind it


def refusal_reason(response: httpx.Response) -> str:
    """The coordinator's reason for a refusal: its {"detail": ...}, else the body's start."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail is not None else response.text[:500]


NO_KEY_HINT = ("; no API key was given: set RAVNEST_KEY or pass --key (an operator's key is the file "
               "operator_token in the coordinator's data directory)")
WRONG_KEY_HINT = ("; this coordinator knows no such API key (an operator's key is the file operator_token in its "
                  "data directory)")


class ApiError(RavnestError, RuntimeError):
    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status  # 0: the coordinator could not be reached


class Api:
    """`url`: the coordinator's URL, or several separated by commas (coordinator processes on one
    store): a call that cannot reach the one in use, or that a proxy answers 502-504 for, goes to the
    next, which stays in use. `key`: the bearer token every call sends unless it names another
    (`token=`). `verify`: e.g. ssl.create_default_context(cafile=...) for a coordinator a private CA
    certified."""

    def __init__(self, url: str, key: str | None, timeout: float = 30.0, verify: ssl.SSLContext | bool = True):
        self.urls = [part.strip().rstrip("/") for part in url.split(",") if part.strip()]
        if not self.urls:
            raise ApiError("no coordinator URL given")
        self.keyed = bool(key)
        # a coordinator that is gone is noticed within CONNECT_S: the next one is tried then
        self._clients = [httpx.Client(base_url=one, timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_S)),
                                      verify=verify, headers={"Authorization": f"Bearer {key}"} if key else None)
                         for one in self.urls]
        self._current = 0

    @property
    def url(self) -> str:
        """The coordinator URL in use."""
        return self.urls[self._current]

    @property
    def http(self) -> httpx.Client:
        """The HTTP client of the coordinator in use."""
        return self._clients[self._current]

    def request(self, method: str, path: str, *, token: str | None = None, headers: dict | None = None,
                prefix: str = "", **kwargs) -> httpx.Response:
        """The response, or ApiError("{prefix}{status}: {reason}") for a refusal or when no coordinator
        could be reached."""
        headers = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
        failed: list[str] = []
        for index in self._in_turn():
            rewind = getattr(kwargs.get("content"), "seek", None)
            if rewind is not None:
                rewind(0)  # (a file: sent again from its start)
            try:
                response = self._clients[index].request(method, path, headers=headers, **kwargs)
            except httpx.HTTPError as e:
                failed.append(f"{self.urls[index]}: {e}")
                continue
            if response.status_code in GATEWAY_ERRORS and len(failed) < len(self.urls) - 1:
                failed.append(f"{self.urls[index]}: {response.status_code}")
                continue
            self._use(index)
            if response.is_error:
                raise self._refused(response, token, prefix)
            return response
        raise ApiError(f"{prefix}cannot reach the coordinator at {'; '.join(failed)}")

    def _in_turn(self) -> list[int]:
        """The coordinators' indices, the one in use first."""
        return [(self._current + i) % len(self.urls) for i in range(len(self.urls))]

    def _use(self, index: int) -> None:
        if index != self._current:
            log.warning("the coordinator at %s did not answer: using %s", self.url, self.urls[index])
            self._current = index

    def _refused(self, response: httpx.Response, token: str | None, prefix: str = "") -> ApiError:
        reason, hint = refusal_reason(response), ""
        if response.status_code == 401 and not token:  # (a node's own credential is no user's to fix)
            hint = NO_KEY_HINT if not self.keyed else WRONG_KEY_HINT if reason == "unknown token" else ""
        return ApiError(f"{prefix}{response.status_code}: {reason}{hint}", response.status_code)

    def call(self, method: str, path: str, **kwargs) -> Any:
        """The JSON body of the answer (None when it has none)."""
        response = self.request(method, path, **kwargs)
        return response.json() if response.content else None

    def page(self, path: str, **params: Any) -> tuple[list, int]:
        """A page of a list (the query's `params`, None left out) and how many items the whole list has."""
        response = self.request("GET", path, params={k: v for k, v in params.items() if v is not None})
        items = response.json()
        return items, int(response.headers.get("X-Total-Count", len(items)))

    def download(self, path: str, target: Path, *, token: str | None = None, params: dict | None = None) -> int:
        """Stream a file to `target` (written whole or not at all); returns its size in bytes."""
        partial = target.with_name(target.name + ".part")
        headers = {"Authorization": f"Bearer {token}"} if token else None
        self.request("GET", "/healthz")  # (finds a coordinator that answers)
        try:
            with self.http.stream("GET", path, params=params, headers=headers) as response:
                if response.is_error:
                    response.read()
                    raise self._refused(response, token)
                with partial.open("wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        out.write(chunk)
        except httpx.HTTPError as e:
            partial.unlink(missing_ok=True)
            raise ApiError(f"cannot reach the coordinator at {self.url}: {e}") from e
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(target)
        return target.stat().st_size

    def close(self) -> None:
        for client in self._clients:
            client.close()
