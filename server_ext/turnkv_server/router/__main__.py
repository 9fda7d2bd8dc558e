"""`python -m turnkv_server.router`: the process the launcher starts (and `turnkv router`)."""

from __future__ import annotations

import argparse
import json
import sys

import uvicorn

from turnkv_server.ports import bind_listener, write_report
from turnkv_server.router import ROUTER_MODES, RouterConfig, create_app
from turnkv_server.router.config import SHORT_DELTA_TOKENS
from turnkv_server.router.sessions import LeasePolicy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="turnkv router", description="turnkv session router")
    parser.add_argument("--prefill", action="append", required=True, help="prefill engine URL")
    parser.add_argument("--decode", action="append", required=True, help="decode engine URL")
    parser.add_argument("--mode", default="turnkv", choices=ROUTER_MODES)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000,
                        help="0: a free port, the kernel's pick (see --port-file)")
    parser.add_argument("--port-file", help="write the address the router listens on, "
                        "HOST:PORT, to this file once it is bound")
    parser.add_argument("--default-ttl", type=float, default=300.0)
    parser.add_argument("--max-ttl", type=float, default=900.0)
    parser.add_argument("--max-sessions", type=int, default=10_000)
    parser.add_argument("--prefill-nixl", action="append", default=[],
                        help="push and turnkv modes: a prefill engine's NIXL side channel, "
                             "ENGINE_ID@HOST:PORT, in --prefill order")
    parser.add_argument("--decode-nixl", action="append", default=[],
                        help="turnkv mode: a decode engine's side channel, "
                             "ENGINE_ID@HOST:PORT, in --decode order")
    parser.add_argument("--decoder-kv-ttl", type=float, default=120.0,
                        help="bidirectional mode: the decode engines' decoder_kv_blocks_ttl")
    parser.add_argument("--short-delta-tokens", type=int, default=SHORT_DELTA_TOKENS,
                        help="turnkv mode: a turn adding at most this many tokens to its "
                             "session is computed on the decode engine alone (0: never)")
    parser.add_argument("--health-interval", type=float, default=2.0,
                        help="seconds between engine health probes")
    parser.add_argument("--redis", help="share sessions with other routers through this "
                        "Redis server, redis://HOST:PORT/DB or unix:///PATH?db=DB "
                        "(or TURNKV_REDIS_URL)")
    parser.add_argument("--engine-read-timeout", type=float, default=600.0,
                        help="seconds an engine may send nothing before its turn fails "
                             "(longer than the longest prefill)")
    parser.add_argument("--api-keys", help="JSON file mapping API key to tenant name")
    parser.add_argument("--admin-key", help="key for admin routes (or TURNKV_ADMIN_KEY)")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    import os

    keys: dict[str, str] = {}
    if args.api_keys:
        with open(args.api_keys) as f:
            keys = json.load(f)
        if not isinstance(keys, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
            raise SystemExit(f"{args.api_keys}: expected a JSON object of key -> tenant")
    return RouterConfig(
        prefill=args.prefill, decode=args.decode, mode=args.mode,
        lease=LeasePolicy(default_ttl=args.default_ttl, max_ttl=args.max_ttl),
        max_sessions=args.max_sessions, api_keys=keys,
        admin_key=args.admin_key or os.environ.get("TURNKV_ADMIN_KEY"),
        health_interval=args.health_interval,
        engine_read_timeout=args.engine_read_timeout,
        prefill_nixl=args.prefill_nixl,
        decode_nixl=args.decode_nixl,
        decoder_kv_ttl=args.decoder_kv_ttl,
        short_delta_tokens=args.short_delta_tokens,
        redis_url=args.redis or os.environ.get("TURNKV_REDIS_URL") or None,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    app = create_app(config_from_args(args))
    # Bound here rather than by uvicorn, so that with --port 0 the port it got is known and
    # reported: whoever starts a router never has to choose a port for it.
    sock = bind_listener(args.host, args.port)
    port = sock.getsockname()[1]
    if args.port_file:
        write_report(args.port_file, args.host, port)
    # Idle client connections stay open longer than clients keep them (httpx and the openai
    # client: 5 s), so a client never reuses a connection the router is closing at that
    # moment; uvicorn's own 5 s made that race (a read error on a fresh request) under load.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="warning",
                                           access_log=False, timeout_keep_alive=30))
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(3)  # uvicorn's STARTUP_FAILURE, as uvicorn.run exits


if __name__ == "__main__":
    main()
