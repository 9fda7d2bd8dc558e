"""The unit tests' servers on free ports of 127.0.0.1: an engine stand-in's aiohttp app, the
router's ASGI app under uvicorn, as deployed, and a standard-library handler in a thread (for
tests of synchronous clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from aiohttp import web


async def _health(_: web.Request) -> web.Response:
    return web.json_response({})


async def start_engine_app(handle: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> tuple[web.AppRunner, str]:
    """An engine stand-in's HTTP side: GET /health answers 200, every POST goes to `handle`.
    The runner (its `cleanup()` stops the server) and the server's URL."""
    app = web.Application()
    app.router.add_get("/health", _health)
    app.router.add_post("/{path:.*}", handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """`app` (ASGI) under uvicorn while the block runs: its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "the router did not start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


@contextlib.contextmanager
def serving_http(handler: type[http.server.BaseHTTPRequestHandler], port: int = 0
                 ) -> Iterator[str]:
    """`handler` served on 127.0.0.1 (`port`, else a free one) in a thread: its base URL.
    Stopped, its socket closed, once the block ends."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
