"""Measure (and profile) the router's own CPU per default turn, without real engines.

The turns are `scripts/router_latency.py`'s: 16 sessions, the same one-message prompt every
turn, in the default `turnkv` mode, whose planner serves an idle home's turn whole (one engine
request). The engines are two stand-ins (`tests/support/standin_chat.py`: token IDs, usage,
`kv_transfer_params`; whole, or streamed as vLLM streams) served by aiohttp where their CPU
is not counted. Two ways to run the router:

- as deployed (the default): `python -m turnkv_server.router` under uvicorn, driven over HTTP
  by this process, the stand-ins in a thread of it (a third busy process would take the
  router's core from it on a 2-core machine and inflate its figure); measured is the router
  process's CPU time (its code, uvicorn, Starlette, its aiohttp client, the event loop).
  Sample it meanwhile with `py-spy record --pid PID` (the PID is printed).
- `--in-process`: the router's ASGI app (`create_app`) in this process, driven by a minimal
  ASGI driver (one scope, one body message, the answer's messages collected) instead of an
  HTTP server, the stand-ins in a child process; measured is this process's CPU time, which
  leaves uvicorn, the sockets and the health probes out. The driver's own share is measured
  by driving a trivial app that answers the same bytes, reported as the floor and not
  subtracted. `--profile FILE` runs the turns under cProfile (slower: the figure printed is
  then the profiled one) and prints the top functions.

The difference of the two is what uvicorn and the sockets cost. `--pause-ms` paces the turns
as deployed the way real engines do (`scripts/router_latency.py`'s turns arrive about 10 ms
apart): a router idle between turns spends more CPU on each than one kept busy. Everything runs
on one shared machine: compare interleaved runs, not absolute figures.

    python scripts/router_cpu.py [--in-process [--profile out.prof] [--top 40]]
                                 [--turns 1000] [--stream] [--pause-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
from aiohttp import web

# Run as `python scripts/router_cpu.py`, Python puts scripts/ on the path, not the repository:
# the stand-in engines answer as the tests' do (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.standin_chat import answer_chat  # noqa: E402
from turnkv_server.ports import read_report  # noqa: E402
from turnkv_server.router.app import create_app  # noqa: E402
from turnkv_server.router.config import RouterConfig  # noqa: E402

SESSIONS = 16
WARM_TURNS = 100  # connections, sessions and code paths warmed before measuring
PREFILL_NIXL, DECODE_NIXL = "p@127.0.0.1:5601", "d@127.0.0.1:5602"  # never dialled
Asgi = Any  # an ASGI application
Post = Callable[[bytes], Awaitable[tuple[int, bytes]]]


async def serve_standins(count: int) -> list[str]:
    """`count` stand-in engines on the running event loop; their URLs."""

    async def chat(request: web.Request) -> web.StreamResponse:
        return await answer_chat(request, orjson.loads(await request.read()))

    async def health(_: web.Request) -> web.StreamResponse:
        return web.json_response({})

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
    return urls


def serve_engines(count: int, pipe: Connection) -> None:
    """A child process's life: `count` stand-in engines; their URLs go back through `pipe`."""

    async def serve() -> None:
        pipe.send(await serve_standins(count))
        await asyncio.Event().wait()

    asyncio.run(serve())


def engines_in_a_thread(count: int) -> list[str]:
    """`count` stand-in engines on an event loop of their own in a daemon thread of this
    process."""
    loop = asyncio.new_event_loop()
    urls = loop.run_until_complete(serve_standins(count))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return urls


def turn_body(i: int, stream: bool) -> bytes:
    return orjson.dumps({"model": "m", "max_tokens": 1, "temperature": 0, "stream": stream,
                         "messages": [{"role": "user", "content": "Say hello in one word."}],
                         "turnkv": {"session_id": f"lat-{i % SESSIONS}"}})


async def run_turns(post: Post, bodies: list[bytes], check: bool, pause_s: float = 0.0) -> None:
    for body in bodies:
        status, answer = await post(body)
        if pause_s:
            await asyncio.sleep(pause_s)
        if check and status != 200:
            raise SystemExit(f"turn failed: {status} {answer[:300]!r}")


def report(args: argparse.Namespace, cpu: float, wall: float, extra: str = "") -> None:
    kind = "streamed" if args.stream else "whole"
    print(f"{kind} turns: router CPU {cpu / args.turns * 1000:.3f} ms per turn "
          f"({args.turns} turns, {wall / args.turns * 1000:.3f} ms wall each{extra})")


# -- as deployed: the router under uvicorn, driven over HTTP ---------------------------------

async def measure_deployed(args: argparse.Namespace, urls: list[str]) -> None:
    port_file = Path(tempfile.mkdtemp()) / "router.port"
    router = subprocess.Popen([
        sys.executable, "-m", "turnkv_server.router", "--port", "0", "--port-file",
        str(port_file), "--mode", "turnkv", "--prefill", urls[0], "--decode", urls[1],
        "--prefill-nixl", PREFILL_NIXL, "--decode-nixl", DECODE_NIXL])
    try:
        deadline = time.monotonic() + 60
        while (address := read_report(port_file)) is None:
            if time.monotonic() > deadline or router.poll() is not None:
                raise SystemExit("the router did not start")
            await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=f"http://{address[0]}:{address[1]}",
                                     timeout=30) as client:

            async def post(body: bytes) -> tuple[int, bytes]:
                answer = await client.post("/v1/chat/completions", content=body,
                                           headers={"content-type": "application/json"})
                return answer.status_code, answer.content

            await run_turns(post, [turn_body(i, args.stream) for i in range(WARM_TURNS)],
                            check=True)
            process = psutil.Process(router.pid)
            print(f"measuring router PID {router.pid}", flush=True)
            before, wall = process.cpu_times(), time.perf_counter()
            await run_turns(post, [turn_body(i, args.stream) for i in range(args.turns)],
                            check=False, pause_s=args.pause_ms / 1000)
            after, wall = process.cpu_times(), time.perf_counter() - wall
        report(args, after.user + after.system - before.user - before.system, wall)
    finally:
        router.terminate()
        router.wait()


# -- in process: the router's ASGI app, driven without sockets -------------------------------

class Driver:
    """Sends requests to an ASGI app as a server would, without sockets or HTTP parsing."""

    def __init__(self, app: Asgi) -> None:
        self.app = app

    async def post(self, body: bytes, path: str = "/v1/chat/completions") -> tuple[int, bytes]:
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


def floor_app(answer: bytes, stream: bool) -> Asgi:
    """A trivial ASGI app that reads the request and answers `answer`: the driver's cost."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        kind = b"text/event-stream" if stream else b"application/json"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": answer})

    return app


async def measure_in_process(args: argparse.Namespace, urls: list[str]) -> None:
    config = RouterConfig(prefill=[urls[0]], decode=[urls[1]], mode="turnkv",
                          prefill_nixl=[PREFILL_NIXL], decode_nixl=[DECODE_NIXL],
                          health_interval=60.0)
    app = create_app(config)
    driver = Driver(app)
    bodies = [turn_body(i, args.stream) for i in range(args.turns)]
    await run_turns(driver.post, [turn_body(i, args.stream) for i in range(WARM_TURNS)],
                    check=True)
    _, answer = await driver.post(bodies[0])
    if not args.stream:  # what the planner decided for a measured turn
        print("a turn's placement:", orjson.loads(answer)["turnkv"]["placement"])
    print(f"measuring PID {os.getpid()}", flush=True)
    profiler = cProfile.Profile() if args.profile else None
    cpu, wall = time.process_time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    await run_turns(driver.post, bodies, check=False)
    if profiler is not None:
        profiler.disable()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await app.state.router.upstream.close()

    floor = Driver(floor_app(answer, args.stream))
    floor_cpu = time.process_time()
    await run_turns(floor.post, bodies, check=True)
    floor_cpu = time.process_time() - floor_cpu
    report(args, cpu, wall, f"; driver floor {floor_cpu / args.turns * 1000:.3f} ms"
           + ("; under cProfile" if profiler is not None else ""))
    if profiler is not None:
        profiler.dump_stats(args.profile)
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="as deployed: wait this long after each answer before the next "
                        "turn (a real engine's answer takes about 10 ms of the tiny model's)")
    parser.add_argument("--in-process", action="store_true",
                        help="the router's ASGI app in this process, without uvicorn")
    parser.add_argument("--profile", help="with --in-process: cProfile the turns into this file")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.pause_ms and args.in_process:
        parser.error("--pause-ms measures the router as deployed, not --in-process")
    if args.profile and not args.in_process:
        parser.error("--profile needs --in-process (sample the deployed router with py-spy)")
    if not args.in_process:
        # Only the router process's CPU is counted: the stand-ins share this process, so the
        # machine runs two busy processes, as the router and its engines' clients would.
        run(measure_deployed(args, engines_in_a_thread(2)))
        return
    # In process this process's CPU is the router's: the stand-ins go to a child process.
    ours, theirs = multiprocessing.Pipe()
    engines = multiprocessing.get_context("spawn").Process(
        target=serve_engines, args=(2, theirs), daemon=True)
    engines.start()
    try:
        run(measure_in_process(args, ours.recv()))
    finally:
        engines.terminate()
        engines.join()


def run(measurement: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
        uvloop.run(measurement)
    except ImportError:
        asyncio.run(measurement)


if __name__ == "__main__":
    main()
