"""The router files one default turn passes through, as docs/architecture.md lists them ("The
files it passes through"): a session's turn on an idle home in the default mode (`turnkv`, the
planner's), non-streamed and streamed, driven through the router's ASGI app in process against
a stand-in engine (an aiohttp server in the same process, answering as vLLM does).

What is measured: a profile hook (`sys.setprofile`) sees every Python call while the turn runs.
A call that lands in a router file (under `turnkv_server/router/`) enters that file when it
comes from another file. Its caller is the nearest router frame up the stack (library frames
between, such as a `min(key=...)` or a pydantic validator, are skipped); with none above it,
the framework or the event loop called it (the route, a streamed body that Starlette iterates
in a task of its own, a task the mode spawned): "outside". A coroutine or generator resumed
after an await or a yield is not entered again: it goes on with the stretch it began.

"Entered once" means that the file is called from exactly one other router file (app.py, where
the turn comes in, from none): the calls between the turn's files form a tree rooted at
app.py. That is what reading the turn top to bottom needs: the reader starts at the route and
meets each other file in exactly one place, the file that calls it, and no file sends the
reader back to one above it (that would be a second caller). Calls from outside are not
counted: the reader follows the router's own calls, not Starlette's task that iterates the
relay. Neither is every call counted: the pipeline's three calls into the stats module are
one place to read it from, and its reader reads it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

import turnkv_server.router
from tests.support.standin_chat import answer_chat
from tests.unit.test_router_engine_requests import StandIn
from turnkv_server.router.app import create_app
from turnkv_server.router.config import RouterConfig

ROUTER = str(Path(turnkv_server.router.__file__).parent) + "/"
OUTSIDE = "(outside)"
MAX_FILES = 8

async def chat_engine(engine: StandIn, request: web.Request, body: dict[str, Any]
                      ) -> web.StreamResponse:
    """vLLM's `/v1/chat/completions` with token IDs: whole, or streamed with its usage chunk."""
    return await answer_chat(request, body)


@dataclass
class FileTrace:
    """Which router files a stretch of code entered, in the order first entered, and from
    where."""

    order: list[str] = field(default_factory=list)
    callers: dict[str, set[str]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)  # every entry, for the report
    _started: set[int] = field(default_factory=set)
    _frames: list[FrameType] = field(default_factory=list)  # keeps the ids above unique

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(ROUTER):
            return
        if id(frame) in self._started:
            return  # a coroutine or generator resumed: the same stretch
        self._started.add(id(frame))
        self._frames.append(frame)
        name = path[len(ROUTER):]
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(ROUTER):
            caller = caller.f_back
        source = OUTSIDE if caller is None else caller.f_code.co_filename[len(ROUTER):]
        if source == name:
            return
        if name not in self.callers:
            self.order.append(name)
            self.callers[name] = set()
        self.callers[name].add(source)
        self.calls[name] = self.calls.get(name, 0) + 1

    @contextlib.contextmanager
    def tracing(self) -> Iterator[FileTrace]:
        sys.setprofile(self.profile)
        try:
            yield self
        finally:
            sys.setprofile(None)
            self._frames.clear()

    def report(self) -> str:
        return "\n".join(f"  {name}: entered {self.calls[name]} times, from "
                         f"{', '.join(sorted(self.callers[name]))}" for name in self.order)


@contextlib.asynccontextmanager
async def default_router() -> AsyncIterator[httpx.AsyncClient]:
    """A router in the default mode in front of one stand-in engine pair, driven in process."""
    engines = [StandIn({"/v1/chat/completions": chat_engine}) for _ in range(2)]
    urls = [await engine.start() for engine in engines]
    config = RouterConfig(prefill=[urls[0]], decode=[urls[1]], mode="turnkv",
                          prefill_nixl=["p@127.0.0.1:5601"], decode_nixl=["d@127.0.0.1:5602"],
                          health_interval=60.0)
    app = create_app(config)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://router",
                                     timeout=30) as client:
            yield client
    finally:
        await app.state.router.upstream.close()
        for engine in engines:
            await engine.stop()


def chat(session: str, stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "stream": stream, "turnkv": {"session_id": session}}


async def traced_turn(stream: bool) -> FileTrace:
    """A session's second turn, traced (its first warms the engines' connections)."""
    async with default_router() as client:
        first = await client.post("/v1/chat/completions", json=chat("s", stream))
        assert first.status_code == 200, first.text
        trace = FileTrace()
        with trace.tracing():
            second = await client.post("/v1/chat/completions", json=chat("s", stream))
        assert second.status_code == 200, second.text
        turn_stats = (second.json()["turnkv"] if not stream else
                      orjson.loads(second.text.split("data: ")[-2].strip())["turnkv"])
        # The planner served it whole on the session's home: one request to one engine.
        assert turn_stats["placement"]["where"] == "whole", turn_stats
        return trace


class GoalNotMet(AssertionError):
    """The turn entered more router files than the goal allows, or some from two files."""


# The files it enters, in order, with their callers, are docs/architecture.md's ("The files it
# passes through").
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_default_turn_reads_in_at_most_eight_router_files_each_entered_once(
        stream: bool) -> None:
    trace = asyncio.run(traced_turn(stream))
    assert trace.order and trace.order[0] == "app.py", trace.report()
    callers = {name: trace.callers[name] - {OUTSIDE} for name in trace.order}
    assert not callers["app.py"], trace.report()
    if len(trace.order) > MAX_FILES:
        raise GoalNotMet(f"{len(trace.order)} router files:\n{trace.report()}")
    twice = [name for name in trace.order[1:] if len(callers[name]) != 1]
    if twice:
        raise GoalNotMet(f"not called from exactly one router file: {twice}\n"
                         f"{trace.report()}")
