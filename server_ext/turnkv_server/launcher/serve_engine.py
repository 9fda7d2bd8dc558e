"""`python -m turnkv_server.launcher.serve_engine --port-file FILE <vLLM server args>`.

vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on a port it binds
itself: with ``--port 0`` the kernel picks a free port, and the port it got is written to FILE
("host:port") for the launcher, so no port is chosen in one process and bound in another.

The socket is bound before vLLM is even imported (vLLM listens on it once it serves, so a
request sent while the engine starts is refused at once, not held), and vLLM serves on it: in
vLLM 0.32, ``setup_server`` (vllm/entrypoints/launchers/launcher.py) binds the API socket by
calling that module's ``create_server_socket((host, port), reuse_port=...)`` before it
starts the engine, and the server then serves on the socket it returned. This wrapper puts
its own function in that module's place, which hands over the socket already bound, and then
runs what ``python -m vllm.entrypoints.openai.api_server`` runs
(``vllm.entrypoints.launchers.api_server.entry.main``) with ``--port`` rewritten to the bound
port, so vLLM's own logs and checks see the real one. If vLLM ever binds without that
function, it binds the same port beside this socket (both SO_REUSEADDR, neither listening) and
serves on its own: the reported port is still the one it serves (a unit test checks the calls
this relies on in vLLM's source).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from turnkv_server.ports import bind_unserved, write_report

PORT_FILE = "--port-file"
# vLLM's own defaults (FrontendArgs): every interface, port 8000.
VLLM_DEFAULT_HOST = ""
VLLM_DEFAULT_PORT = 8000


class UsageError(ValueError):
    pass


def split_args(argv: Sequence[str]) -> tuple[Path, list[str]]:
    """(the port file, vLLM's arguments): ``--port-file FILE`` (or ``=FILE``) comes first."""
    args = list(argv)
    if args and args[0].startswith(PORT_FILE + "="):
        return Path(args[0].split("=", 1)[1]), args[1:]
    if len(args) >= 2 and args[0] == PORT_FILE:
        return Path(args[1]), args[2:]
    raise UsageError(f"usage: serve_engine {PORT_FILE} FILE <vLLM server arguments>")


def option(args: Sequence[str], name: str) -> str | None:
    """The value of the last ``name VALUE`` or ``name=VALUE`` in `args` (argparse's rule)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def with_option(args: Sequence[str], name: str, value: str) -> list[str]:
    """`args` with every ``name`` option dropped and ``name value`` appended."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == name:
            skip = i + 1 < len(args)
            continue
        if arg.startswith(name + "="):
            continue
        out.append(arg)
    return [*out, name, value]


def listen_address(args: Sequence[str]) -> tuple[str, int]:
    host = option(args, "--host") or VLLM_DEFAULT_HOST
    port_text = option(args, "--port")
    try:
        port = VLLM_DEFAULT_PORT if port_text is None else int(port_text)
    except ValueError:
        raise UsageError(f"--port: not a number: {port_text!r}") from None
    if option(args, "--uds") is not None:
        raise UsageError("--uds: this wrapper serves TCP only")
    return host, port


def adopter(sock: socket.socket, host: str, port: int
            ) -> Callable[..., socket.socket]:
    """A stand-in for vLLM's ``create_server_socket``: the bound socket, for its address only."""
    def create_server_socket(addr: tuple[str, int], *, reuse_port: bool = False
                             ) -> socket.socket:
        if tuple(addr) != (host, port) or reuse_port:
            raise RuntimeError(f"serve_engine holds {host}:{port}; vLLM asked for {addr} "
                               f"(reuse_port={reuse_port})")
        return sock
    return create_server_socket


def main(argv: Sequence[str] | None = None) -> None:
    try:
        port_file, args = split_args(sys.argv[1:] if argv is None else argv)
        host, port = listen_address(args)
    except UsageError as exc:
        raise SystemExit(str(exc)) from None
    sock = bind_unserved(host, port)
    bound = sock.getsockname()[1]
    args = with_option(args, "--port", str(bound))
    write_report(port_file, host or "127.0.0.1", bound)

    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.launchers.api_server import entry

    launcher.create_server_socket = adopter(sock, host, bound)
    sys.argv = [sys.argv[0], *args]
    entry.main()


if __name__ == "__main__":
    main()
