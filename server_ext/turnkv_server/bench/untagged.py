"""A stock client's conversation for the benchmark's `<mode>-untagged` modes: the turns the
driver plays, sent by a plain `openai.AsyncOpenAI` that names no session and sends no hints,
as most chat code does. The router recognises each conversation from its content
(docs/protocol.md, "Conversations nobody tagged").

It stands in for the SDK's session where the driver uses one (`hint`, `stream`, the stream's
`turn`), so that both play the same workload the same way. To measure the turn it asks for
`stream_options.include_usage` (as LangChain's `ChatOpenAI` does with `stream_usage`): the
router then puts the turn's stats in the usage chunk, which names no session either.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import openai

import turnkv


@dataclass(frozen=True)
class UntaggedTurn:
    """What the driver reads of a played turn, as of the SDK's `Turn`."""

    stats: turnkv.TurnStats | None
    text: str


class UntaggedStream:
    """A streamed turn's chunks, as the openai client gives them; `turn` once it ended."""

    def __init__(self, raw: Any, sent: float) -> None:
        self._raw = raw
        self._sent = sent
        self.turn: UntaggedTurn | None = None

    async def __aiter__(self) -> AsyncIterator[Any]:
        text: list[str] = []
        wire: dict[str, Any] | None = None
        usage: dict[str, Any] | None = None
        first: float | None = None
        async for chunk in self._raw:
            extra = chunk.model_extra or {}
            if isinstance(extra.get("turnkv"), dict):
                wire = extra["turnkv"]
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            yield chunk
        ttft = None if first is None else (first - self._sent) * 1000
        total = (time.perf_counter() - self._sent) * 1000
        if wire is not None:
            stats = turnkv.TurnStats.from_wire(wire, client_ttft_ms=ttft, client_total_ms=total)
        else:  # a plain engine (`single`): what its usage says
            stats = turnkv.TurnStats.from_usage(usage, session_id=None, turn=0,
                                                client_ttft_ms=ttft, client_total_ms=total)
        self.turn = UntaggedTurn(stats, "".join(text))

    async def close(self) -> None:
        await self._raw.close()


class UntaggedSession:
    """One conversation of a stock client: every turn the whole history, nothing else."""

    def __init__(self, client: openai.AsyncOpenAI) -> None:
        self._client = client

    def hint(self, **_: Any) -> None:
        """A stock client knows nothing of hints: sends none."""

    async def stream(self, **request: Any) -> UntaggedStream:
        sent = time.perf_counter()
        raw = await self._client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **request)
        return UntaggedStream(raw, sent)
