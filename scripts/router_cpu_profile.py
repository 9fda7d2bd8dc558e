"""Measure and profile the router's CPU per default turn in process, without engines or uvicorn.

The router's ASGI app (`create_app`, the default `turnkv` mode, whose planner serves an idle
home's turn whole: one engine request) runs in this process, driven by a minimal ASGI driver
(one scope, one body message, the response's messages collected) instead of an HTTP server.
Its engines are two stand-ins (`tests/support/standin_chat.py`: token IDs, usage,
`kv_transfer_params`; whole, or streamed as vLLM streams) served by aiohttp in a child
process, so their CPU is not this process's: what `time.process_time` measures here is the
router's own work per turn (Starlette, the router's code, its aiohttp client to the engines,
the event loop) plus the driver's. The driver's share is measured too, by driving a trivial
ASGI app that answers the same bytes, and reported as the floor; it is not subtracted.

Limits: no uvicorn (its HTTP parsing and per-request work are not measured), no health probes
(the app's lifespan does not run), one machine shared with the child process (compare runs,
not absolute figures). The turns are `scripts/router_latency.py`'s: 16 sessions, the same
one-message prompt every turn.

    python scripts/router_cpu_profile.py [--turns 600] [--stream] [--profile out.prof]
                                         [--top 40]

With `--profile`, the measured turns run under cProfile (slower; the figure printed is then
the profiled one) and the top functions by own time are printed; or sample this process with
`py-spy record --pid PID` while it runs without `--profile`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing
import os
import pstats
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

# Run as `python scripts/...`, Python puts scripts/ on the path, not the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.standin_chat import answer_chat  # noqa: E402
from turnkv_server.router.app import create_app  # noqa: E402
from turnkv_server.router.config import RouterConfig  # noqa: E402

SESSIONS = 16
Asgi = Any  # an ASGI application


def serve_engines(count: int, pipe: Connection) -> None:
    """The child process: `count` stand-in engines; their URLs go back through `pipe`."""

    async def chat(request: web.Request) -> web.StreamResponse:
        return await answer_chat(request, orjson.loads(await request.read()))

    async def health(_: web.Request) -> web.StreamResponse:
        return web.json_response({})

    async def serve() -> None:
        urls = []
        for _ in range(count):
            app = web.Application()
            app.router.add_get("/health", health)
            app.router.add_post("/v1/chat/completions", chat)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        pipe.send(urls)
        await asyncio.Event().wait()

    asyncio.run(serve())


class Driver:
    """Sends requests to an ASGI app as a server would, without sockets or HTTP parsing."""

    def __init__(self, app: Asgi) -> None:
        self.app = app

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
                 "server": ("router", 80),
                 "headers": [(b"host", b"router"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(body)).encode())]}
        done = asyncio.Event()
        sent = False
        status, parts = 0, []

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()  # the client stays until its answer has come
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    done.set()

        await self.app(scope, receive, send)
        done.set()
        return status, b"".join(parts)


def turn_body(i: int, stream: bool) -> bytes:
    return orjson.dumps({"model": "m", "max_tokens": 1, "temperature": 0, "stream": stream,
                         "messages": [{"role": "user", "content": "Say hello in one word."}],
                         "turnkv": {"session_id": f"lat-{i % SESSIONS}"}})


async def run_turns(driver: Driver, bodies: list[bytes], check: bool) -> None:
    for body in bodies:
        status, answer = await driver.post("/v1/chat/completions", body)
        if check and status != 200:
            raise SystemExit(f"turn failed: {status} {answer[:300]!r}")


def floor_app(answer: bytes, stream: bool) -> Asgi:
    """A trivial ASGI app that reads the request and answers `answer`: the driver's cost."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        kind = b"text/event-stream" if stream else b"application/json"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": answer})

    return app


async def measure(args: argparse.Namespace, urls: list[str]) -> None:
    config = RouterConfig(prefill=[urls[0]], decode=[urls[1]], mode="turnkv",
                          prefill_nixl=["p@127.0.0.1:5601"], decode_nixl=["d@127.0.0.1:5602"],
                          health_interval=60.0)
    app = create_app(config)
    driver = Driver(app)
    warm = [turn_body(i, args.stream) for i in range(args.warm)]
    bodies = [turn_body(i, args.stream) for i in range(args.turns)]
    await run_turns(driver, warm, check=True)
    _, answer = await driver.post("/v1/chat/completions", bodies[0])
    if not args.stream:  # what the planner decided for a measured turn
        print("a turn's placement:", orjson.loads(answer)["turnkv"]["placement"])
    profiler = cProfile.Profile() if args.profile else None
    cpu, wall = time.process_time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    await run_turns(driver, bodies, check=False)
    if profiler is not None:
        profiler.disable()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await app.state.router.upstream.close()

    floor = Driver(floor_app(answer, args.stream))
    floor_cpu = time.process_time()
    await run_turns(floor, bodies, check=True)
    floor_cpu = time.process_time() - floor_cpu

    kind = "streamed" if args.stream else "whole"
    print(f"{kind} turns: {cpu / args.turns * 1000:.3f} ms CPU per turn "
          f"({args.turns} turns, {wall / args.turns * 1000:.3f} ms wall each; "
          f"driver floor {floor_cpu / args.turns * 1000:.3f} ms)"
          + (" [under cProfile]" if profiler is not None else ""))
    if profiler is not None:
        profiler.dump_stats(args.profile)
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=600)
    parser.add_argument("--warm", type=int, default=100)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--profile", help="profile the measured turns into this file")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    ours, theirs = multiprocessing.Pipe()
    engines = multiprocessing.get_context("spawn").Process(
        target=serve_engines, args=(2, theirs), daemon=True)
    engines.start()
    try:
        urls = ours.recv()
        print(f"measuring PID {os.getpid()}", flush=True)
        try:
            import uvloop
            uvloop.run(measure(args, urls))
        except ImportError:
            asyncio.run(measure(args, urls))
    finally:
        engines.terminate()
        engines.join()


if __name__ == "__main__":
    main()
