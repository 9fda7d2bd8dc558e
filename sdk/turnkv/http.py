"""httpx clients that tag turns and record their stats: what `turnkv.OpenAI` uses, and what
LangChain / LlamaIndex get as `http_client` / `http_async_client`.

A request is tagged when it is a POST to a `/chat/completions` or `/completions` path, carries
no `X-TurnKV-Session` header of its own, and there is a session: the one the client was
built with, else the ambient `turnkv.session(...)`.
"""

from __future__ import annotations

from typing import Any

import httpx

import turnkv.protocol as p
from turnkv.context import pending_for
from turnkv.core import PendingTurn, SessionCore
from turnkv.observe import observe_response
from turnkv.tagging import is_turn_request

# openai's own defaults for its http client.
DEFAULT_TIMEOUT = httpx.Timeout(timeout=600.0, connect=5.0)
DEFAULT_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100)


def _begin(client: Any, request: httpx.Request) -> PendingTurn | None:
    if p.HEADER_SESSION in request.headers or not is_turn_request(request.method,
                                                                   request.url.path):
        return None
    pending = pending_for(client.turnkv_session)
    if pending is None:
        return None
    try:
        body: bytes | None = request.content
    except httpx.RequestNotRead:  # a streamed body: no prefix ID from it
        body = None
    request.headers.update(pending.headers_for(str(request.url), body, request.headers))
    return pending


class TaggingClient(httpx.Client):
    def __init__(self, *, session: SessionCore | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.turnkv_session = session

    def send(self, request: httpx.Request, *, stream: bool = False, **kwargs: Any
             ) -> httpx.Response:
        pending = _begin(self, request)
        if pending is None:
            return super().send(request, stream=stream, **kwargs)
        try:
            response = super().send(request, stream=True, **kwargs)
        except BaseException:
            pending.fail()
            raise
        observe_response(response, pending, asynchronous=False)
        if not stream:
            try:
                response.read()
            finally:
                response.close()
        return response


class AsyncTaggingClient(httpx.AsyncClient):
    def __init__(self, *, session: SessionCore | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.turnkv_session = session

    async def send(self, request: httpx.Request, *, stream: bool = False, **kwargs: Any
                   ) -> httpx.Response:
        pending = _begin(self, request)
        if pending is None:
            return await super().send(request, stream=stream, **kwargs)
        try:
            response = await super().send(request, stream=True, **kwargs)
        except BaseException:
            pending.fail()
            raise
        observe_response(response, pending, asynchronous=True)
        if not stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response


def _defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs.setdefault("timeout", DEFAULT_TIMEOUT)
    kwargs.setdefault("limits", DEFAULT_LIMITS)
    kwargs.setdefault("follow_redirects", True)
    return kwargs


def http_client(session: SessionCore | None = None, **httpx_kwargs: Any) -> httpx.Client:
    """An `httpx.Client` that tags turns with `session` (or the ambient session) and records
    their stats into it. Any `httpx.Client` argument is accepted."""
    return TaggingClient(session=session, **_defaults(httpx_kwargs))


def async_http_client(session: SessionCore | None = None, **httpx_kwargs: Any
                      ) -> httpx.AsyncClient:
    """The `httpx.AsyncClient` counterpart of `http_client`."""
    return AsyncTaggingClient(session=session, **_defaults(httpx_kwargs))


def is_tagging_client(value: object) -> bool:
    return isinstance(value, (TaggingClient, AsyncTaggingClient))
