"""One HTTP client for short requests to the servers of a cluster this process runs or
watches: the launcher's health probes, the engines' counters, the tests' and scripts' checks.

`httpx.get` and its siblings build a client per call, and each client a TLS context that loads
the CA bundle: 53 ms of CPU per call on the test machine (0.3 ms through a client made once),
and the launcher probes every starting engine twice a second, on the cores where the engines
are importing vLLM. These requests are plain HTTP to loopback or to simulated hosts, so one
client made once serves them all. It keeps no connection alive: an engine restarted on the
same port must not be probed over its predecessor's closed socket.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx

__all__ = ["answers_health", "client", "get", "post"]


@functools.cache
def client() -> httpx.Client:
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def get(url: str, **kwargs: Any) -> httpx.Response:
    return client().get(url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return client().post(url, **kwargs)


def answers_health(url: str, timeout: float = 2.0) -> bool:
    """True if the server at `url` answers its `/health` with 200; False if it answers
    otherwise, or not at all (not listening yet, gone, too slow)."""
    try:
        return get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False
