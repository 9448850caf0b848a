"""A thin client of the coordinator's REST API: every refusal becomes one ApiError with the
coordinator's reason and status."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx


def refusal_reason(response: httpx.Response) -> str:
    """The coordinator's reason for a refusal: its {"detail": ...}, else the body's start."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    return str(detail) if detail is not None else response.text[:500]


class ApiError(RuntimeError):
    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status  # 0: the coordinator could not be reached


class Api:
    def __init__(self, url: str, key: str | None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {key}"} if key else None)

    def call(self, method: str, path: str, **kwargs) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise ApiError(f"cannot reach the coordinator at {self.url}: {e}") from None
        if response.is_error:
            raise ApiError(f"{response.status_code}: {refusal_reason(response)}", response.status_code)
        return response.json() if response.content else None

    def download(self, path: str, target: Path) -> int:
        """Stream a file to `target` (written whole or not at all); returns its size in bytes."""
        partial = target.with_name(target.name + ".part")
        try:
            with self.http.stream("GET", path) as response:
                if response.is_error:
                    response.read()
                    raise ApiError(f"{response.status_code}: {refusal_reason(response)}", response.status_code)
                with partial.open("wb") as out:
                    for chunk in response.iter_bytes(1 << 20):
                        out.write(chunk)
        except httpx.HTTPError as e:
            partial.unlink(missing_ok=True)
            raise ApiError(f"cannot reach the coordinator at {self.url}: {e}") from None
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        partial.replace(target)
        return target.stat().st_size

    def close(self) -> None:
        self.http.close()
