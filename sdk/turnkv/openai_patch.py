"""Tagging STOCK openai clients inside `with turnkv.session(...)`.

A stock `openai.OpenAI` / `AsyncOpenAI` builds its requests itself, with its own http client,
so turnkv wraps three methods of openai's base clients, once per process (idempotent), when
the first turnkv client (`turnkv.OpenAI` / `AsyncOpenAI`) or `turnkv.session()` is created:

- `request` (sync and async): a turn request made while a session is active gets a pending
  turn for the whole call, so openai's own retries of it reuse the same turn index; a call
  that fails gives the index back;
- `_build_request`: adds the `X-TurnKV-*` headers;
- `_process_response`: watches the response (JSON body, or the SSE stream as the caller
  reads it) and records the turn's stats into the session.

`request` also names the URL that did not answer when a turnkv client's request, or a turn of
a session, finds no server (`turnkv.ServerUnreachableError`).

Clients whose http client is one of turnkv's (`turnkv.OpenAI`, or any client given
`turnkv.http_client()`) are left alone: their http client does the same work.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import openai
from openai import _base_client as base

import turnkv.context as context
import turnkv.protocol as p
from turnkv.core import PendingTurn
from turnkv.errors import ServerUnreachableError
from turnkv.http import is_tagging_client
from turnkv.observe import observe_response
from turnkv.tagging import TURN_PATHS

_lock = threading.Lock()
_installed = False
_MARK = "__turnkv_patched__"


def installed() -> bool:
    return _installed


def install() -> None:
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        for cls, asynchronous in ((base.SyncAPIClient, False), (base.AsyncAPIClient, True)):
            _wrap(cls, "request", _async_request if asynchronous else _sync_request)
            _wrap(cls, "_process_response",
                  _async_process if asynchronous else _sync_process)
        _wrap(base.BaseClient, "_build_request", _build_request)
        _installed = True


def _wrap(cls: type, name: str, make: Any) -> None:
    original = cls.__dict__.get(name)
    if original is None or getattr(original, _MARK, False):
        return
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)


def _is_turn(options: Any) -> bool:
    url = str(getattr(options, "url", "") or "")
    method = str(getattr(options, "method", "") or "")
    return method.lower() == "post" and url.split("?", 1)[0].rstrip("/").endswith(TURN_PATHS)


def _own_turn(client: Any, options: Any) -> PendingTurn | None:
    """A pending turn this call owns, or None (nothing to tag, already pinned, or turnkv's
    own http client does the tagging)."""
    if is_tagging_client(getattr(client, "_client", None)) or context.pinned_turn() is not None:
        return None
    session = context.current_session()
    if session is None or not _is_turn(options):
        return None
    return session.begin_turn(managed=True)


def _settle_failed(pending: PendingTurn) -> None:
    if pending.turn is None:
        pending.give_up()


@contextlib.contextmanager
def _named_unreachable(client: Any, pending: PendingTurn | None) -> Iterator[None]:
    """A request of turnkv's (a turnkv client's, or a turn of a session) that found no
    server raises `ServerUnreachableError`, which names the URL and how to check it, in place
    of openai's bare "Connection error."; other clients' errors are left as they are."""
    try:
        yield
    except openai.APIConnectionError as exc:
        ours = (pending is not None or context.pinned_turn() is not None
                or is_tagging_client(getattr(client, "_client", None)))
        if not ours or isinstance(exc, (openai.APITimeoutError, ServerUnreachableError)):
            raise
        url = str(getattr(client, "base_url", exc.request.url)).rstrip("/")
        raise ServerUnreachableError(url, exc.request, exc) from exc


def _sync_request(original: Any) -> Any:
    def request(self: Any, *args: Any, **kwargs: Any) -> Any:
        options = args[1] if len(args) > 1 else kwargs.get("options")
        pending = _own_turn(self, options)
        with _named_unreachable(self, pending):
            if pending is None:
                return original(self, *args, **kwargs)
            with context.pinning(pending):
                try:
                    return original(self, *args, **kwargs)
                except BaseException:
                    _settle_failed(pending)
                    raise
    return request


def _async_request(original: Any) -> Any:
    async def request(self: Any, *args: Any, **kwargs: Any) -> Any:
        options = args[1] if len(args) > 1 else kwargs.get("options")
        pending = _own_turn(self, options)
        with _named_unreachable(self, pending):
            if pending is None:
                return await original(self, *args, **kwargs)
            with context.pinning(pending):
                try:
                    return await original(self, *args, **kwargs)
                except BaseException:
                    _settle_failed(pending)
                    raise
    return request


def _build_request(original: Any) -> Any:
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = original(self, *args, **kwargs)
        pending = context.pinned_turn()
        if (pending is None or is_tagging_client(getattr(self, "_client", None))
                or p.HEADER_SESSION in request.headers):
            return request
        try:
            body: bytes | None = request.content
        except Exception:  # noqa: BLE001 -- a streamed (multipart) body: no prefix from it
            body = None
        request.headers.update(pending.headers_for(str(request.url), body, request.headers))
        return request
    return build


def _ours(response: Any) -> PendingTurn | None:
    pending = context.pinned_turn()
    if pending is None or pending.settled:
        return None
    if response.request.headers.get(p.HEADER_SESSION) != pending.session.id:
        return None
    return pending


def _sync_process(original: Any) -> Any:
    def process(self: Any, *args: Any, **kwargs: Any) -> Any:
        response = kwargs.get("response")
        pending = _ours(response) if response is not None else None
        if pending is not None:
            observe_response(response, pending, asynchronous=False)
        return original(self, *args, **kwargs)
    return process


def _async_process(original: Any) -> Any:
    async def process(self: Any, *args: Any, **kwargs: Any) -> Any:
        response = kwargs.get("response")
        pending = _ours(response) if response is not None else None
        if pending is not None:
            observe_response(response, pending, asynchronous=True)
        return await original(self, *args, **kwargs)
    return process

