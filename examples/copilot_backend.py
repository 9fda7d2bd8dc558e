"""A copilot backend: a small HTTP service that keeps one turnkv session per conversation.

A chat front end sends each user message here; the service keeps the conversation, sends it
to the turnkv router as the next turn of that conversation's session (so the router keeps its
KV on the same engines between messages) and returns the reply with the turn's stats.

    python examples/copilot_backend.py --base-url http://127.0.0.1:PORT/v1 [--port 8100]

    POST   /conversations/{id}/messages  {"content": "..."}  the reply and the turn's stats
    GET    /conversations/{id}           the messages so far and the session's totals
    DELETE /conversations/{id}           end the conversation and release its session

At most `--max-conversations` are kept; opening one more ends the least recently used idle
one (its session is released on the router too).
"""

from __future__ import annotations

import argparse
import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import openai
import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

import turnkv
from turnkv.protocol import is_valid_id

SYSTEM = "You are a helpful coding assistant. Answer briefly."


class MessageIn(BaseModel):
    content: str = Field(min_length=1, max_length=32_000)
    max_tokens: int = Field(default=128, ge=1, le=4096)


@dataclass
class Conversation:
    id: str
    session: turnkv.AsyncSession
    messages: list[dict[str, Any]]
    # One turn at a time: turn N+1 must extend the history that turn N left.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Conversations:
    """The conversations in memory, least recently used first."""

    def __init__(self, client: turnkv.AsyncOpenAI, *, limit: int, system: str) -> None:
        if limit < 1:
            raise ValueError("keep at least one conversation")
        self.client = client
        self.limit = limit
        self.system = system
        self._open: OrderedDict[str, Conversation] = OrderedDict()

    def get(self, conversation_id: str) -> Conversation | None:
        found = self._open.get(conversation_id)
        if found is not None:
            self._open.move_to_end(conversation_id)
        return found

    async def open(self, conversation_id: str) -> Conversation:
        found = self.get(conversation_id)
        if found is not None:
            return found
        while len(self._open) >= self.limit:
            idle = next((c for c in self._open.values() if not c.lock.locked()), None)
            if idle is None:
                raise HTTPException(503, "every conversation slot is busy; try again")
            await self.end(idle.id)
        found = self.get(conversation_id)  # opened by a request that ran while we waited
        if found is not None:
            return found
        session = self.client.session(f"copilot-{conversation_id}")
        conversation = Conversation(conversation_id, session,
                                    [{"role": "system", "content": self.system}])
        self._open[conversation_id] = conversation
        return conversation

    async def end(self, conversation_id: str) -> bool | None:
        """Forget the conversation and release its session: True if the router held it,
        None if there was no such conversation."""
        conversation = self._open.pop(conversation_id, None)
        if conversation is None:
            return None
        async with conversation.lock:
            if not conversation.session.turns:
                return False
            return bool(await conversation.session.release())

    async def end_all(self) -> None:
        for conversation_id in list(self._open):
            await self.end(conversation_id)


def create_app(client: turnkv.AsyncOpenAI, model: str, *, max_conversations: int = 100,
               system: str = SYSTEM) -> FastAPI:
    conversations = Conversations(client, limit=max_conversations, system=system)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await conversations.end_all()

    app = FastAPI(title="turnkv copilot backend", lifespan=lifespan)
    app.state.conversations = conversations

    @app.post("/conversations/{conversation_id}/messages")
    async def send(conversation_id: str, message: MessageIn) -> dict[str, Any]:
        _check_id(conversation_id)
        conversation = await conversations.open(conversation_id)
        async with conversation.lock:
            messages = [*conversation.messages, {"role": "user", "content": message.content}]
            try:
                turn = await conversation.session.chat(
                    messages=messages, model=model, max_tokens=message.max_tokens)
            except openai.APIStatusError as exc:
                raise HTTPException(502, f"the model server answered {exc.status_code}: "
                                         f"{exc.message}") from exc
            except openai.APIConnectionError as exc:
                raise HTTPException(502, f"the model server is unreachable: {exc}") from exc
            # Only a turn that happened joins the history, verbatim, so the next prompt
            # extends what the router holds for this session.
            conversation.messages = [*messages, {"role": "assistant", "content": turn.text}]
        return {"conversation_id": conversation_id, "session_id": conversation.session.id,
                "turn": turn.index, "reply": turn.text, "stats": turn.stats.model_dump()}

    @app.get("/conversations/{conversation_id}")
    async def show(conversation_id: str) -> dict[str, Any]:
        conversation = conversations.get(conversation_id)
        if conversation is None:
            raise HTTPException(404, f"no conversation {conversation_id!r}")
        return {"conversation_id": conversation_id, "session_id": conversation.session.id,
                "messages": conversation.messages,
                "stats": conversation.session.stats.model_dump()}

    @app.delete("/conversations/{conversation_id}")
    async def end(conversation_id: str) -> dict[str, Any]:
        released = await conversations.end(conversation_id)
        if released is None:
            raise HTTPException(404, f"no conversation {conversation_id!r}")
        return {"conversation_id": conversation_id, "released": released}

    return app


def _check_id(conversation_id: str) -> None:
    # The ID becomes part of the session ID, which travels in headers and URLs.
    if len(conversation_id) > 100 or not is_valid_id(conversation_id):
        raise HTTPException(400, "conversation IDs are 1-100 characters of [A-Za-z0-9._:-], "
                                 "starting with a letter or digit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="the turnkv router's /v1 URL")
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--api-key", default="local")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--max-conversations", type=int, default=100)
    parser.add_argument("--system", default=SYSTEM, help="the system prompt")
    args = parser.parse_args()
    model = args.model or openai.OpenAI(base_url=args.base_url,
                                        api_key=args.api_key).models.list().data[0].id
    client = turnkv.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key)
    app = create_app(client, model, max_conversations=args.max_conversations,
                     system=args.system)
    # Loopback only: the service has no authentication of its own.
    uvicorn.run(app, host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
