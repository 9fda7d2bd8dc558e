"""Router configuration: pools, mode, leases, tenants."""

from __future__ import annotations

from dataclasses import dataclass, field

from turnkv_server.router.registry import MODES
from turnkv_server.router.sessions import LeasePolicy

ROUTER_MODES = tuple(MODES)
# Measured with `turnkv bench` (docs/benchmarks.md, "Short deltas on the decode engine").
SHORT_DELTA_TOKENS = 512


@dataclass(frozen=True)
class RouterConfig:
    prefill: list[str]
    decode: list[str]
    mode: str = "standard"
    lease: LeasePolicy = field(default_factory=LeasePolicy)
    max_sessions: int = 10_000
    # API key -> tenant name. Empty: no authentication, one tenant.
    api_keys: dict[str, str] = field(default_factory=dict)
    admin_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    health_interval: float = 2.0
    # An engine that sends nothing for this long fails the turn (retried on another pair, or
    # an error): no turn waits on a hung engine forever. It must exceed the longest prefill.
    engine_read_timeout: float = 600.0
    # A turn that fails on an unavailable engine is retried on another pair this many times.
    retries: int = 1
    # push and turnkv: each prefill engine's NIXL side channel, ENGINE_ID@HOST:PORT, in
    # --prefill order; turnkv also needs the decode engines' (it pushes both ways).
    prefill_nixl: list[str] = field(default_factory=list)
    decode_nixl: list[str] = field(default_factory=list)
    # bidirectional: how long decode engines hold a finished turn (decoder_kv_blocks_ttl).
    decoder_kv_ttl: float = 120.0
    # turnkv: a turn adding at most this many tokens to its session is computed on the decode
    # engine alone, which holds the session's history; 0 turns it off.
    short_delta_tokens: int = SHORT_DELTA_TOKENS
    # Sessions shared by every router on this Redis server (redis://HOST:PORT/DB); None: this
    # router's memory only.
    redis_url: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(ROUTER_MODES)}")
        if self.engine_read_timeout <= 0:
            raise ValueError("engine_read_timeout must be positive")
        if self.short_delta_tokens < 0:
            raise ValueError("short_delta_tokens must be non-negative")
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one prefill and one decode engine")
        if self.mode == "push" and len(self.prefill_nixl) != len(self.prefill):
            raise ValueError("push mode needs --prefill-nixl ENGINE_ID@HOST:PORT for every "
                             "prefill engine")
        if self.mode == "turnkv" and (len(self.prefill_nixl) != len(self.prefill)
                                      or len(self.decode_nixl) != len(self.decode)):
            raise ValueError("turnkv mode needs --prefill-nixl and --decode-nixl "
                             "ENGINE_ID@HOST:PORT for every engine")
