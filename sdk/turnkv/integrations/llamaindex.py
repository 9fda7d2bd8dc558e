"""LlamaIndex: `TurnKVLLM`, an `OpenAILike` whose calls are turns of one turnkv session.

    from turnkv.integrations.llamaindex import TurnKVLLM

    llm = TurnKVLLM(model="smollm2-135m-instruct", api_base="http://127.0.0.1:8000/v1",
                    api_key="local", ttl=120)
    response = llm.chat(messages)
    response.additional_kwargs["turnkv"]      # the turn's stats (a dict)
    response.additional_kwargs["cache_read"]  # prompt tokens the prefill engine did not compute
    response.raw                              # the openai response, with the router's `turnkv`
    llm.close()     # releases the session (as do `with TurnKVLLM(...) as llm:` and its GC)

`chat`, `achat`, `stream_chat`, `astream_chat` (and `complete`, which LlamaIndex sends as a
chat turn here) go through `turnkv.http_client(session)` / `turnkv.async_http_client(session)`,
which tag each call with the session's next turn index, prefix ID and hints, and record its
stats into the session (`llm.session.turns`, `llm.session.stats`). A stream carries the stats
on its last response. A session is one conversation, one turn at a time: use one LLM per
conversation.

Needs the `llamaindex` extra (`llama-index-llms-openai-like`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from turnkv.core import SessionCore
from turnkv.http import async_http_client, http_client
from turnkv.integrations import raise_extra_missing
from turnkv.integrations.stream_tail import StreamTail
from turnkv.integrations.turns import (
    STATS_KEY,
    SessionHold,
    SessionOwner,
    cache_read,
    open_session,
    stats_for,
    wire_of,
)
from turnkv.stats import TurnStats

try:
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
    )
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.llms.openai_like import OpenAILike
except ModuleNotFoundError as exc:
    # `pip install turnkv` has no LlamaIndex: say which extra brings it.
    raise_extra_missing(exc, "llamaindex", ("llama_index",),
                        "LlamaIndex", "turnkv.integrations.llamaindex")

CACHE_READ_KEY = "cache_read"


class TurnKVLLM(SessionOwner, OpenAILike):
    """An `OpenAILike` bound to a turnkv session.

    Give it a `session` (a `turnkv.Session` you manage), or let it open one from `session_id`
    (None: a random ID), `ttl`, `priority`, `prefix_id` and `keep`; `close()` / `aclose()`
    (or the end of a `with` / `async with` block) then releases that session on the router
    unless `keep=True`, and so does the LLM's garbage collection if it was never closed (not
    at interpreter exit: there the lease ends it). Every other argument is `OpenAILike`'s;
    `is_chat_model` defaults to True (the server applies the chat template).
    `http_client` / `async_http_client` default to turnkv's tagging clients for the session:
    replacing them leaves the calls untagged.
    """

    is_chat_model: bool = Field(
        default=True, description="Send chat turns to /chat/completions.")
    _turnkv_hold: Any = PrivateAttr(default=None)

    def __init__(
        self, *, session: SessionCore | None = None, session_id: str | None = None,
        ttl: float | None = None, priority: int | None = None, prefix_id: str | None = None,
        keep: bool = False, **kwargs: Any,
    ) -> None:
        if kwargs.get("reuse_client") is False:
            # LlamaIndex would then close the openai client, and the tagging http client
            # with it, after every call.
            raise ValueError("TurnKVLLM needs reuse_client=True")
        bound, owned = open_session(session, session_id=session_id, ttl=ttl,
                                    priority=priority, prefix_id=prefix_id, keep=keep)
        kwargs.setdefault("http_client", http_client(bound))
        kwargs.setdefault("async_http_client", async_http_client(bound))
        super().__init__(**kwargs)
        self._turnkv_hold = SessionHold(bound, owned)

    @classmethod
    def class_name(cls) -> str:
        return "TurnKVLLM"


    def _get_model_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        model_kwargs: dict[str, Any] = super()._get_model_kwargs(**kwargs)
        if model_kwargs.get("stream"):
            # Usage in streams too, so that servers without turnkv still give stats.
            model_kwargs.setdefault("stream_options", {"include_usage": True})
        return model_kwargs

    # -- non-streamed ------------------------------------------------------------------------

    def _chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = super()._chat(messages, **kwargs)
        return self._annotate(response)

    async def _achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = await super()._achat(messages, **kwargs)
        return self._annotate(response)

    def _annotate(self, response: ChatResponse) -> ChatResponse:
        raw = response.raw
        stats = stats_for(self.session, wire_of(raw), getattr(raw, "id", None))
        if stats is not None:
            _put(response, stats)
        return response

    # -- streamed ----------------------------------------------------------------------------

    def _stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        since = len(self.session.turns)
        return ResponseTail(self.session, since).relay(super()._stream_chat(messages, **kwargs))

    async def _astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any
                            ) -> ChatResponseAsyncGen:
        since = len(self.session.turns)
        inner = await super()._astream_chat(messages, **kwargs)
        return ResponseTail(self.session, since).arelay(inner)


class ResponseTail(StreamTail[ChatResponse]):
    """A LlamaIndex stream's tail: the turn's stats go on its last response (a copy of the
    stream's last message where no response was held)."""

    def __init__(self, session: SessionCore, since: int) -> None:
        super().__init__(session, since)
        self.last: ChatResponse | None = None

    def take(self, item: ChatResponse) -> list[ChatResponse]:
        self.last = item
        return super().take(item)

    def carries_content(self, item: ChatResponse) -> bool:
        return bool(item.delta or item.message.additional_kwargs.get("tool_calls"))

    def wire(self, item: ChatResponse) -> dict[str, Any] | None:
        return wire_of(item.raw)

    def attach(self, held: list[ChatResponse], stats: TurnStats) -> list[ChatResponse]:
        if self.last is None:
            return held
        if not held:
            held.append(ChatResponse(message=self.last.message, delta=""))
        _put(held[-1], stats)
        return held


def _put(response: ChatResponse, stats: TurnStats) -> None:
    response.additional_kwargs[STATS_KEY] = stats.model_dump()
    reused = cache_read(stats)
    if reused is not None:
        response.additional_kwargs[CACHE_READ_KEY] = reused


__all__ = ["CACHE_READ_KEY", "TurnKVLLM"]
