"""`local_http`: the one client for probes of a local cluster's servers, against a real HTTP
server on loopback."""

from __future__ import annotations

import contextlib
import http.server

from tests.support.local_servers import serving_http
from turnkv_server import local_http


class _Health(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps a client's connection open, as uvicorn does
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def serving(status: int, port: int = 0) -> contextlib.AbstractContextManager[str]:
    return serving_http(type("Handler", (_Health,), {"status": status}), port)


def test_health_is_a_200_and_nothing_else() -> None:
    with serving(200) as url:
        assert local_http.answers_health(url)
    with serving(503) as url:
        assert not local_http.answers_health(url)
    # Nothing listens there any more.
    assert not local_http.answers_health(url, timeout=1.0)


def test_one_client_and_no_connection_kept_for_a_server_started_again() -> None:
    """A server stopped and started again on its port (an engine restarted) is probed afresh,
    through the same client: a connection kept open to the old one would still hear its
    answer."""
    assert local_http.client() is local_http.client()
    with serving(200) as url:
        assert local_http.answers_health(url)
        port = int(url.rsplit(":", 1)[1])
    with serving(503, port) as again:
        assert not local_http.answers_health(again)
