"""Listening ports: whoever binds a port binds port 0 itself and reports the port it got.

A port chosen as free in one process and bound in another, later, can be taken by anything on
the machine in between: a vLLM engine binds its NIXL side channel only once its model has
loaded, minutes after start, and a second cluster's router had taken that port meanwhile. So
a cluster's servers (the engines' HTTP servers, their side channels, the router) bind port 0,
where the kernel picks a free port and binds it in one step, and write "host:port" to a report
file that the launcher reads.

A server restarted on the port it had before (its peers know that address) cannot do that;
`PortHold` keeps such a port bound between its processes.

Standard library only: the engine wrapper imports this before vLLM.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable
from pathlib import Path

# The file a KV connector writes its side channel's bound "host:port" to (the turnkv
# connector and `turnkv_server.engine.nixl_tuning`'s NIXL connectors), when this variable names one.
SIDE_CHANNEL_REPORT_ENV = "TURNKV_SIDE_CHANNEL_REPORT"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_listener(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket bound to (host, port), 0 for a free port, and listening.

    Listening at once matters: a bound socket that does not listen yet can share its port with
    another SO_REUSEADDR bind of that port (vLLM, uvicorn and ZeroMQ all set it), a listening
    one cannot. Connections that arrive before the server accepts wait in the backlog.
    SO_REUSEADDR as every server sets it, so a restart binds while old connections linger in
    TIME_WAIT, and a `PortHold` of this port does not stand in the way.
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def bind_unserved(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), 0 for a free port, not listening yet: the server
    listens once it serves. Until then a connection is refused at once, which callers read as
    "not up" (a listening socket would queue it, unanswered, until the server is ready: a
    restarting engine would hold every request sent to it for its whole start).

    Bound as vLLM binds its own socket (SO_REUSEADDR). The kernel never gives a bound port to
    another port-0 bind; only a server binding this very port with SO_REUSEADDR could share
    it before it listens.
    """
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> tuple[str, int]:
    """ "host:port" (IPv6 hosts in brackets) -> (host, port); ValueError if it is not one."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"not a host:port address: {text!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"not a port: {port_text!r} in {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def write_report(path: str | os.PathLike[str], host: str, port: int) -> None:
    """Write "host:port" to `path` whole (a reader never sees half of it): write, then rename."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(format_address(host, port) + "\n")
    os.replace(tmp, target)


def read_report(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """The (host, port) a server reported in `path`; None while there is no report yet."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    return parse_address(text)


class PortHold:
    """Keeps ports bound, without listening, until `release()`.

    Nothing else can bind a held port (a bind without SO_REUSEADDR fails, and while other
    ports are free the kernel gives a held one neither to another port-0 bind nor to an
    outgoing connection), except a server that binds that very port with SO_REUSEADDR: the one
    it is held for. That is how a server
    restarted on its old port gets it back although its model loads for minutes before it
    binds. Best effort: a port that is taken already is not held (`missing`), and the server's
    own bind then fails with the error that says so.
    """

    def __init__(self, host: str, ports: Iterable[int]) -> None:
        self._sockets: list[socket.socket] = []
        self.missing: list[int] = []
        for port in ports:
            sock = socket.socket(_family(host), socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                self.missing.append(port)
                continue
            self._sockets.append(sock)

    @property
    def ports(self) -> list[int]:
        return [sock.getsockname()[1] for sock in self._sockets]

    def release(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
        self._sockets = []

    def __enter__(self) -> PortHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
