"""The router's session API (`/v1/turnkv/sessions/{id}`): release and hints."""

from __future__ import annotations

from typing import Any

import httpx

from turnkv import protocol as p
from turnkv.errors import TurnKVError

TIMEOUT_S = 10.0


def session_url(base_url: str, session_id: str) -> str:
    return f"{base_url.rstrip('/')}/turnkv/sessions/{session_id}"


def _released(response: httpx.Response) -> bool:
    if response.status_code == 404:
        return False  # already gone: ended by a final turn, expired, or never reached it
    _check(response)
    return True


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        raise TurnKVError(f"{response.request.method} {response.request.url} answered "
                          f"{response.status_code}: {response.text[:300]}")
    return response.json()


def release(base_url: str, session_id: str, headers: dict[str, str]) -> bool:
    """True if the router held the session and released it, False if it held none."""
    with httpx.Client(timeout=TIMEOUT_S) as client:
        return _released(client.delete(session_url(base_url, session_id), headers=headers))


async def arelease(base_url: str, session_id: str, headers: dict[str, str]) -> bool:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        return _released(await client.delete(session_url(base_url, session_id),
                                             headers=headers))


def post_hints(base_url: str, session_id: str, headers: dict[str, str],
               hints: p.CacheHints) -> dict[str, Any]:
    with httpx.Client(timeout=TIMEOUT_S) as client:
        return dict(_check(client.post(f"{session_url(base_url, session_id)}/hints",
                                       json=hints.model_dump(exclude_none=True),
                                       headers=headers)))


async def apost_hints(base_url: str, session_id: str, headers: dict[str, str],
                      hints: p.CacheHints) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        return dict(_check(await client.post(f"{session_url(base_url, session_id)}/hints",
                                             json=hints.model_dump(exclude_none=True),
                                             headers=headers)))
