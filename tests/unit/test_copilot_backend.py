"""The copilot backend's conversation table: bounded, least recently used idle one out first.

No turn is sent here: a conversation without turns is forgotten without calling the server.
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi import HTTPException

import turnkv
from examples.copilot_backend import Conversations


def _table(limit: int) -> Conversations:
    client = turnkv.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused")
    return Conversations(client, limit=limit, system="be brief")


def test_the_least_recently_used_conversation_makes_room() -> None:
    async def play() -> None:
        table = _table(limit=2)
        first = await table.open("c1")
        await table.open("c2")
        assert table.get("c1") is first  # c1 is now the most recently used
        third = await table.open("c3")
        assert table.get("c2") is None and table.get("c1") is first
        assert third.session.id == "copilot-c3"
        assert third.messages == [{"role": "system", "content": "be brief"}]
        assert await table.end("c3") is False  # it never had a turn on the router
        assert await table.end("c3") is None

    asyncio.run(play())


def test_a_conversation_with_a_turn_in_flight_is_not_evicted() -> None:
    async def play() -> None:
        table = _table(limit=2)
        first = await table.open("c1")
        await table.open("c2")
        async with first.lock:  # c1, the least recently used, has a turn in flight
            await table.open("c3")
            assert table.get("c2") is None and table.get("c1") is first
            async with (await table.open("c3")).lock:
                with pytest.raises(HTTPException) as caught:
                    await table.open("c4")
                assert caught.value.status_code == 503

    asyncio.run(play())
