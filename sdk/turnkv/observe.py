"""Watching a turn's response go by: its stats, usage, text and timing, without changing a
byte of what the caller reads.

Works on responses of both `httpx` and `httpx2` (openai 3 uses the latter for its own
clients): the response's byte stream is replaced by a subclass of the same library's stream
type that passes every chunk through.

What is observed goes to a `Listener`: the pending turn (`turnkv.core.PendingTurn`), which
records it into its session. The listener is a protocol so that this module knows nothing of
sessions.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionMessage

from turnkv.sse import SSEReader


@dataclass
class Observed:
    """What one response said about its turn."""

    wire: dict[str, Any] | None = None  # the `turnkv` field
    usage: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)  # X-TurnKV-* response headers
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    body: dict[str, Any] | None = None  # the JSON body of a non-streamed turn
    streamed: bool = False
    chat: bool = True
    ttft_ms: float | None = None
    total_ms: float | None = None

    def message(self) -> Any:
        """The assistant message as an openai `ChatCompletionMessage` (None for
        `/completions`); rebuilt from the chunks for a streamed turn."""
        if not self.chat:
            return None
        raw: Any = {"role": "assistant", "content": self.text or None,
                    "tool_calls": self.tool_calls or None}
        if self.body is not None:
            choices = self.body.get("choices") or [{}]
            raw = choices[0].get("message") if isinstance(choices[0], dict) else None
        try:
            return ChatCompletionMessage.model_validate(raw)
        except ValueError:
            return None

    def response(self) -> Any:
        """The openai `ChatCompletion` / `Completion` of a non-streamed turn."""
        if self.body is None:
            return None
        model = ChatCompletion if self.chat else Completion
        try:
            return model.model_validate(self.body)
        except ValueError:
            return None


class Listener(Protocol):
    """Who hears how a response ended: `complete` with what it said, or `fail`."""

    started: float  # perf_counter() at the turn's start: times are measured from it
    early_headers: dict[str, str]  # set to the response's X-TurnKV-* headers on arrival

    def complete(self, observed: Observed) -> None: ...

    def fail(self) -> None: ...


class Observer:
    def __init__(self, pending: Listener, headers: Mapping[str, str], url: str) -> None:
        self.pending = pending
        self.result = Observed(
            headers={k.lower(): v for k, v in headers.items() if k.lower().startswith("x-turnkv")},
            streamed="text/event-stream" in headers.get("content-type", ""),
            chat=url.split("?", 1)[0].rstrip("/").endswith("/chat/completions"),
        )
        pending.early_headers = self.result.headers
        self._decoder = _decoder(headers.get("content-encoding", ""))
        self._sse = SSEReader()
        self._raw = bytearray()
        self._done_seen = False
        self._tools: dict[int, dict[str, Any]] = {}
        self._finished = False

    # -- input -----------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        if self._finished or self._decoder is None:
            return
        data = self._decoder.decompress(chunk) if self._decoder is not _IDENTITY else chunk
        if not self.result.streamed:
            self._raw += data
            return
        for payload in self._sse.feed(data):
            self._event(payload)

    def feed_body(self, content: bytes) -> None:
        """A body that was read (and decoded) before the observer could see it."""
        self._decoder = _IDENTITY
        self.feed(content)
        self.finish(exhausted=True)

    def finish(self, exhausted: bool) -> None:
        if self._finished:
            return
        self._finished = True
        result = self.result
        if result.streamed:
            for payload in self._sse.close():
                self._event(payload)
            complete = exhausted or self._done_seen or result.wire is not None
        else:
            result.body = _json_object(bytes(self._raw)) if exhausted else None
            complete = result.body is not None
            if result.body is not None:
                self._take_body(result.body)
        result.total_ms = (time.perf_counter() - self.pending.started) * 1000
        result.tool_calls = [self._tools[i] for i in sorted(self._tools)]
        if complete:
            self.pending.complete(result)
        else:
            self.pending.fail()

    # -- parsing ---------------------------------------------------------------------------

    def _event(self, payload: str) -> None:
        if payload.strip() == "[DONE]":
            self._done_seen = True
            return
        chunk = _json_object(payload.encode())
        if chunk is None:
            return
        if isinstance(chunk.get("turnkv"), dict):
            self.result.wire = chunk["turnkv"]
        if isinstance(chunk.get("usage"), dict):
            self.result.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content") if self.result.chat else choice.get("text")
            if (text or delta.get("tool_calls") or delta.get("reasoning")
                    or delta.get("reasoning_content")) and self.result.ttft_ms is None:
                self.result.ttft_ms = (time.perf_counter() - self.pending.started) * 1000
            if text:
                self.result.text += text
            for call in delta.get("tool_calls") or []:
                self._tool_delta(call)

    def _tool_delta(self, call: dict[str, Any]) -> None:
        slot = self._tools.setdefault(int(call.get("index", 0)), {
            "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        slot["function"]["name"] += function.get("name") or ""
        slot["function"]["arguments"] += function.get("arguments") or ""

    def _take_body(self, body: dict[str, Any]) -> None:
        if isinstance(body.get("turnkv"), dict):
            self.result.wire = body["turnkv"]
        if isinstance(body.get("usage"), dict):
            self.result.usage = body["usage"]
        choices = body.get("choices") or [{}]
        first = choices[0] if isinstance(choices[0], dict) else {}
        if self.result.chat:
            message = first.get("message") or {}
            self.result.text = message.get("content") or ""
        else:
            self.result.text = first.get("text") or ""


class _Identity:
    def decompress(self, data: bytes) -> bytes:
        return data


_IDENTITY = _Identity()


def _decoder(encoding: str) -> Any:
    """None where the body cannot be read here (e.g. brotli): the turn then has no stats."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return _IDENTITY
    if encoding == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompressobj()
    return None


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# -- wrapping a response's byte stream ------------------------------------------------------

_CLASSES: dict[str, tuple[type, type]] = {}


def _stream_classes(module_name: str) -> tuple[type, type]:
    if module_name in _CLASSES:
        return _CLASSES[module_name]
    module = sys.modules[module_name]

    class ObservedSyncStream(module.SyncByteStream):  # type: ignore[name-defined]
        def __init__(self, inner: Any, observer: Observer) -> None:
            self._inner = inner
            self._observer = observer

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self._inner:
                self._observer.feed(chunk)
                yield chunk
            self._observer.finish(exhausted=True)

        def close(self) -> None:
            try:
                self._inner.close()
            finally:
                self._observer.finish(exhausted=False)

    class ObservedAsyncStream(module.AsyncByteStream):  # type: ignore[name-defined]
        def __init__(self, inner: Any, observer: Observer) -> None:
            self._inner = inner
            self._observer = observer

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self._inner:
                self._observer.feed(chunk)
                yield chunk
            self._observer.finish(exhausted=True)

        async def aclose(self) -> None:
            try:
                await self._inner.aclose()
            finally:
                self._observer.finish(exhausted=False)

    _CLASSES[module_name] = (ObservedSyncStream, ObservedAsyncStream)
    return _CLASSES[module_name]


def observe_response(response: Any, pending: Listener, asynchronous: bool) -> None:
    """Attach the pending turn to a response of httpx or httpx2."""
    if response.status_code != 200:
        pending.fail()
        return
    observer = Observer(pending, response.headers, str(response.request.url))
    content = getattr(response, "_content", None)
    if isinstance(content, bytes):
        observer.feed_body(content)
        return
    module_name = type(response).__module__.split(".", 1)[0]
    sync_cls, async_cls = _stream_classes(module_name)
    if asynchronous:
        response.stream = async_cls(response.stream, observer)
    else:
        response.stream = sync_cls(response.stream, observer)

