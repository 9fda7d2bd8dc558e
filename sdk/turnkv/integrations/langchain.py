"""LangChain: `ChatTurnKV`, a `ChatOpenAI` whose calls are turns of one turnkv session.

    from turnkv.integrations.langchain import ChatTurnKV

    llm = ChatTurnKV(model="smollm2-135m-instruct", base_url="http://127.0.0.1:8000/v1",
                     api_key="local", ttl=120)
    reply = llm.invoke(messages)
    reply.response_metadata["turnkv"]                        # the turn's stats (a dict)
    reply.usage_metadata["input_token_details"]["cache_read"]  # prompt tokens not recomputed
    llm.close()      # releases the session (as do `with ChatTurnKV(...) as llm:` and its GC)

Every call (`invoke`, `ainvoke`, `stream`, `astream`, and those of tool-bound models from
`bind_tools`) goes through `turnkv.http_client(session)` / `turnkv.async_http_client(session)`,
which tag it with the session's next turn index, prefix ID and hints, and record its stats
into the session (`llm.session.turns`, `llm.session.stats`). Streams carry the stats on
their last chunk, so the merged message has them too. A session is one conversation, one
turn at a time: use one model per conversation (not `batch` over unrelated prompts).

Needs the `langchain` extra (`langchain-openai`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
from pydantic import PrivateAttr

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
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.outputs import ChatGenerationChunk, ChatResult
    from langchain_openai import ChatOpenAI
except ModuleNotFoundError as exc:
    # `pip install turnkv` has no LangChain: say which extra brings it.
    raise_extra_missing(exc, "langchain", ("langchain_core", "langchain_openai"),
                        "LangChain", "turnkv.integrations.langchain")


class ChatTurnKV(SessionOwner, ChatOpenAI):
    """A `ChatOpenAI` bound to a turnkv session.

    Give it a `session` (a `turnkv.Session` you manage), or let it open one from `session_id`
    (None: a random ID), `ttl`, `priority`, `prefix_id` and `keep`; `close()` / `aclose()`
    (or the end of a `with` / `async with` block) then releases that session on the router
    unless `keep=True`, and so does the model's garbage collection if it was never closed
    (not at interpreter exit: there the lease ends it). Every other argument is
    `ChatOpenAI`'s. `stream_usage` defaults to True, so that streams report usage on servers
    without turnkv too. `http_client` / `http_async_client` default to turnkv's tagging
    clients for the session: replacing them leaves the calls untagged.
    """

    stream_usage: bool | None = True
    _turnkv_hold: Any = PrivateAttr(default=None)

    def __init__(
        self, *, session: SessionCore | None = None, session_id: str | None = None,
        ttl: float | None = None, priority: int | None = None, prefix_id: str | None = None,
        keep: bool = False, **kwargs: Any,
    ) -> None:
        bound, owned = open_session(session, session_id=session_id, ttl=ttl,
                                    priority=priority, prefix_id=prefix_id, keep=keep)
        # ChatOpenAI sends everything through these: they tag the turns and record stats.
        kwargs.setdefault("http_client", http_client(bound))
        kwargs.setdefault("http_async_client", async_http_client(bound))
        super().__init__(**kwargs)
        self._turnkv_hold = SessionHold(bound, owned)


    # -- non-streamed calls ------------------------------------------------------------------

    def _create_chat_result(self, response: dict[str, Any] | openai.BaseModel,
                            generation_info: dict[str, Any] | None = None) -> ChatResult:
        result = super()._create_chat_result(response, generation_info)
        response_id = (response.get("id") if isinstance(response, dict)
                       else getattr(response, "id", None))
        stats = stats_for(self.session, wire_of(response), response_id)
        if stats is not None:
            for generation in result.generations:
                if isinstance(generation.message, AIMessage):
                    generation.message.response_metadata[STATS_KEY] = stats.model_dump()
                    _set_usage(generation.message, stats, already_read=0)
        return result

    # -- streamed calls ----------------------------------------------------------------------

    def _convert_chunk_to_generation_chunk(
        self, chunk: dict[str, Any], default_chunk_class: type,
        base_generation_info: dict[str, Any] | None,
    ) -> ChatGenerationChunk | None:
        generation = super()._convert_chunk_to_generation_chunk(
            chunk, default_chunk_class, base_generation_info)
        wire = wire_of(chunk)
        if generation is not None and wire is not None:
            # The router's part, replaced by the session's full record once the stream ends.
            generation.message.response_metadata[STATS_KEY] = wire
        return generation

    def _stream(self, *args: Any, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        yield from ChunkTail(self.session).relay(super()._stream(*args, **kwargs))

    async def _astream(self, *args: Any, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for out in ChunkTail(self.session).arelay(super()._astream(*args, **kwargs)):
            yield out


class ChunkTail(StreamTail[ChatGenerationChunk]):
    """A LangChain stream's tail: the turn's stats go on its last chunk, its usage on the chunk
    that reported usage (vLLM's usage chunk), else on the last one."""

    def __init__(self, session: SessionCore) -> None:
        super().__init__(session)
        self.cache_read_sent = 0  # cache_read already reported by chunks passed through

    def take(self, item: ChatGenerationChunk) -> list[ChatGenerationChunk]:
        out = super().take(item)
        self.cache_read_sent += sum(_cache_read_of(sent.message) for sent in out)
        return out

    def carries_content(self, item: ChatGenerationChunk) -> bool:
        return bool(item.message.content or getattr(item.message, "tool_call_chunks", None))

    def wire(self, item: ChatGenerationChunk) -> dict[str, Any] | None:
        value = item.message.response_metadata.get(STATS_KEY)
        return value if isinstance(value, dict) else None

    def attach(self, held: list[ChatGenerationChunk], stats: TurnStats
               ) -> list[ChatGenerationChunk]:
        for chunk in held:
            chunk.message.response_metadata.pop(STATS_KEY, None)
        if not held:
            held.append(ChatGenerationChunk(message=AIMessageChunk(content="")))
        last = held[-1].message
        usage_chunk = next((c.message for c in held
                            if isinstance(c.message, AIMessageChunk) and c.message.usage_metadata),
                           last)
        if isinstance(usage_chunk, AIMessageChunk):
            _set_usage(usage_chunk, stats, already_read=self.cache_read_sent)
        last.response_metadata[STATS_KEY] = stats.model_dump()
        if isinstance(last, AIMessageChunk):
            # LangChain appends an empty closing chunk unless the last one says it is last.
            last.chunk_position = "last"
        return held


def _cache_read_of(message: BaseMessage) -> int:
    usage = getattr(message, "usage_metadata", None) or {}
    return int((usage.get("input_token_details") or {}).get("cache_read") or 0)


def _set_usage(message: AIMessage, stats: TurnStats, already_read: int) -> None:
    """`cache_read` = the prompt tokens the prefill engine did not compute. On a stream the
    chunks' usage adds up when merged: `already_read` is what earlier chunks reported."""
    reused = cache_read(stats)
    usage: UsageMetadata = message.usage_metadata or UsageMetadata(
        input_tokens=stats.prompt_tokens.total, output_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens.total + stats.completion_tokens)
    if reused is not None:
        details = dict(usage.get("input_token_details") or {})
        details["cache_read"] = reused - already_read
        usage["input_token_details"] = details  # type: ignore[typeddict-item]
    message.usage_metadata = usage


__all__ = ["ChatTurnKV"]
