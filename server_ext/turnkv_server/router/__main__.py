"""`python -m turnkv_server.router`: the process the launcher starts (and `turnkv router`)."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from turnkv_server.ports import bind_listener, write_report
from turnkv_server.router.app import create_app
from turnkv_server.router.config import add_arguments, from_args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnkv router", description="turnkv session router")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000,
                        help="0: a free port, the kernel's pick (see --port-file)")
    parser.add_argument("--port-file", help="write the address the router listens on, "
                        "HOST:PORT, to this file once it is bound")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = from_args(args)
    except ValueError as exc:
        # Which engines a mode needs is checked by the settings, not by argparse: say it the
        # same way as a missing flag.
        parser.error(str(exc))
    app = create_app(config)
    # Bound here rather than by uvicorn, so that with --port 0 the port it got is known and
    # reported: whoever starts a router never has to choose a port for it.
    sock = bind_listener(args.host, args.port)
    port = sock.getsockname()[1]
    if args.port_file:
        write_report(args.port_file, args.host, port)
    # Idle client connections stay open longer than clients keep them (httpx and the openai
    # client: 5 s), so a client never reuses a connection the router is closing at that
    # moment; uvicorn's own 5 s made that race (a read error on a fresh request) under load.
    # No proxy headers: the router reads no client address (tenants are API keys, and it keeps
    # no access log), and uvicorn would rewrite every request's scope for them.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="warning",
                                           access_log=False, timeout_keep_alive=30,
                                           proxy_headers=False))
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE, as uvicorn.run exits


if __name__ == "__main__":
    main()
