"""`FakeServer`'s answers over a real local socket, with the router's session API: for unit
tests of what an SDK object sends outside its tagging client (the release of a session is a
request of its own, `turnkv.session_api`).

Only for pure SDK logic; the router's real behaviour is tested against real engines in
tests/integration/.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from tests.support.fake_openai import FakeServer


@dataclass
class FakeRouter:
    url: str  # the OpenAI base URL: http://127.0.0.1:PORT/v1
    chat: FakeServer
    # `DELETE /v1/turnkv/sessions/{id}`: the IDs, in order.
    released: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def wait_released(self, count: int, timeout: float = 30.0) -> list[str]:
        """The released IDs once there are `count` (or the timeout has passed)."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.released) >= count, timeout)
            return list(self.released)


def _handler(router: FakeRouter) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 -- http.server's name
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            request = httpx.Request("POST", f"http://fake{self.path}",
                                    headers=dict(self.headers.items()), content=body)
            response = router.chat(request)
            content = response.read()
            self.send_response(response.status_code)
            for name, value in response.headers.items():
                if name.lower() not in ("content-length", "transfer-encoding"):
                    self.send_header(name, value)
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def do_DELETE(self) -> None:  # noqa: N802
            session_id = self.path.rstrip("/").rsplit("/", 1)[-1]
            # Recorded before the answer goes: a client that has its answer finds it recorded.
            with router.changed:
                router.released.append(session_id)
                router.changed.notify_all()
            content = json.dumps({"session_id": session_id, "released": True}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextmanager
def fake_router(chat: FakeServer | None = None) -> Iterator[FakeRouter]:
    router = FakeRouter(url="", chat=chat or FakeServer())
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(router))
    router.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield router
    finally:
        server.shutdown()
        server.server_close()
