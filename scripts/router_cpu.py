"""Measure the router's own CPU per default turn without engines.

Starts the router as deployed (`python -m turnkv_server.router` under uvicorn, the default
`turnkv` mode, whose planner serves an idle home's turn whole: one engine request) in front of
two stand-in engines (aiohttp servers in this process that answer `/v1/chat/completions` as vLLM
does: token IDs, usage, `kv_transfer_params`; whole or streamed in five chunks), sends turns of
16 sessions through it and reports the router process's CPU time per turn. Nothing waits on an
engine's computation, so what the router spends is most of what is measured; the client and
the stand-ins run on the same machine, so run it on an otherwise quiet one and compare runs,
not absolute figures. To see where the time goes, sample the router meanwhile
(`py-spy record -p PID`; the PID is printed).

    python scripts/router_cpu.py [--turns 1500] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
import psutil
from aiohttp import web

from turnkv_server.ports import read_report

# Run as `python scripts/router_cpu.py`, Python puts scripts/ on the path, not the repository:
# the stand-in engines answer as the tests' do (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.standin_chat import answer_chat  # noqa: E402


async def _chat(request: web.Request) -> web.StreamResponse:
    return await answer_chat(request, orjson.loads(await request.read()))


async def _health(_: web.Request) -> web.StreamResponse:
    return web.json_response({})


def start_engines(count: int) -> list[str]:
    """`count` stand-in engines' URLs, served on an event loop of their own (a daemon
    thread)."""
    loop = asyncio.new_event_loop()

    async def serve() -> str:
        app = web.Application()
        app.router.add_get("/health", _health)
        app.router.add_post("/v1/chat/completions", _chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    urls = [loop.run_until_complete(serve()) for _ in range(count)]
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return urls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=1500)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    prefill, decode = start_engines(2)
    port_file = Path(tempfile.mkdtemp()) / "router.port"
    command = [sys.executable, "-m", "turnkv_server.router", "--port", "0",
               "--port-file", str(port_file), "--mode", "turnkv", "--prefill", prefill,
               "--decode", decode, "--prefill-nixl", "p@127.0.0.1:1",
               "--decode-nixl", "d@127.0.0.1:2"]
    router = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + 60
        while (address := read_report(port_file)) is None:
            if time.monotonic() > deadline or router.poll() is not None:
                raise SystemExit("the router did not start")
            time.sleep(0.1)
        with httpx.Client(base_url=f"http://{address[0]}:{address[1]}", timeout=30) as client:

            def turn(i: int) -> None:
                client.post("/v1/chat/completions", json={
                    "model": "m", "max_tokens": 8, "stream": args.stream,
                    "messages": [{"role": "user", "content": "hi"}],
                    "turnkv": {"session_id": f"cpu-{i % 16}"}}).raise_for_status()

            for i in range(100):  # warm connections, sessions and code paths
                turn(i)
            process = psutil.Process(router.pid)
            print(f"measuring router PID {router.pid}", flush=True)
            before, started = process.cpu_times(), time.perf_counter()
            for i in range(args.turns):
                turn(i)
            after, wall = process.cpu_times(), time.perf_counter() - started
        cpu = (after.user + after.system - before.user - before.system) / args.turns
        print(f"{'streamed' if args.stream else 'whole'} turns: router CPU {cpu * 1000:.3f} ms "
              f"per turn ({args.turns} turns, {wall / args.turns * 1000:.2f} ms each)")
    finally:
        router.terminate()
        router.wait()


if __name__ == "__main__":
    main()
