"""The router's settings, declared once.

Each field of `RouterConfig` that a command line may set carries its help (and its environment
variable, if any) in its metadata. `python -m turnkv_server.router` (which `turnkv router` runs
and the launcher starts) builds its parser from them (`add_arguments`, `from_args`); `turnkv up`
and `turnkv bench` show the same help (`help_for`) for the settings they pass on to it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any, cast, get_type_hints

from turnkv_server.mode_names import DEFAULT_MODE, ROUTER_MODES, RouterMode
from turnkv_server.router.decisions import CHOICES, Choice
from turnkv_server.router.sessions import LeasePolicy
from turnkv_server.router.tenants import (
    DEFAULT_TENANT,
    TenantCaps,
    default_max_priority,
    load_tenant_caps,
)

# Measured with `turnkv bench` (docs/benchmarks.md, "Short deltas on the decode engine").
SHORT_DELTA_TOKENS = 512


@dataclass(frozen=True)
class Option:
    """How a setting reads from the command line: `--NAME` (the field's name, dashed)."""

    help: str
    flag: str | None = None  # another flag than `--NAME`
    env: str | None = None  # the environment variable read when the flag is not given
    repeat: bool = False  # given once per engine, in engine order
    load: Callable[[str], Any] | None = None  # the flag's value -> the setting's


def cli(help: str, **how: Any) -> dict[str, Option]:
    return {"cli": Option(help, **how)}


def load_api_keys(path: str) -> dict[str, str]:
    with open(path) as f:
        keys = json.load(f)
    if not isinstance(keys, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in keys.items()):
        raise SystemExit(f"{path}: expected a JSON object of key -> tenant")
    return keys


@dataclass(frozen=True)
class RouterConfig:
    prefill: list[str] = field(default_factory=list, metadata=cli(
        "a prefill engine's URL", repeat=True))
    decode: list[str] = field(default_factory=list, metadata=cli(
        "a decode engine's URL", repeat=True))
    # Affinity mode's engines, instead of prefill and decode ones.
    engine: list[str] = field(default_factory=list, metadata=cli(
        "affinity mode: an aggregated engine's URL (it serves its sessions' turns whole)",
        repeat=True))
    mode: RouterMode = field(default=DEFAULT_MODE, metadata=cli(
        "serving mode (see docs/protocol.md)"))
    default_ttl: float = field(default=LeasePolicy.default_ttl, metadata=cli(
        "seconds a session's lease lasts after a turn that gives no ttl hint"))
    max_ttl: float = field(default=LeasePolicy.max_ttl, metadata=cli(
        "the longest lease a client's hints may ask for, in seconds"))
    max_sessions: int = field(default=10_000, metadata=cli(
        "sessions the table holds; when it is full, the idle session with the lowest priority, "
        "then the least recently used, goes first"))
    # API key -> tenant name. Empty: no authentication, one tenant.
    api_keys: dict[str, str] = field(default_factory=dict, metadata=cli(
        "JSON file mapping API key to tenant name", load=load_api_keys))
    admin_key: str | None = field(default=None, metadata=cli(
        "key for admin routes", env="TURNKV_ADMIN_KEY"))
    # None: 0 with API keys, uncapped without (router/tenants.py).
    max_priority: int | None = field(default=None, metadata=cli(
        "the highest priority hint a tenant's clients may send (higher is lowered to it), "
        "for tenants without their own in --tenant-caps (default: 0 with --api-keys, so that "
        "no tenant's leases go before another's by priority; without keys, uncapped)",
        load=int))
    min_next_turn_in: float = field(default=0.0, metadata=cli(
        "the soonest next turn, in seconds, a tenant's clients may announce (`next_turn_in`; "
        "sooner is put off to it), for tenants without their own in --tenant-caps"))
    # Tenant -> its caps (`max_priority`, `min_next_turn_in`), each optional.
    tenant_caps: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=cli(
        "JSON file mapping tenant name to its caps, {\"max_priority\": N, "
        "\"min_next_turn_in\": SECONDS}, each optional (the defaults above fill in)",
        load=load_tenant_caps))
    max_body_bytes: int = 16 * 1024 * 1024
    health_interval: float = field(default=2.0, metadata=cli(
        "seconds between engine health probes"))
    # An engine that sends nothing for this long fails the turn (retried on another pair, or
    # an error): no turn waits on a hung engine forever. It must exceed the longest prefill.
    engine_read_timeout: float = field(default=600.0, metadata=cli(
        "seconds an engine may send nothing before its turn fails (longer than the longest "
        "prefill)"))
    # A turn that fails on an unavailable engine is retried on another pair this many times.
    retries: int = 1
    # turnkv also needs the decode engines' side channels: it pushes both ways.
    prefill_nixl: list[str] = field(default_factory=list, metadata=cli(
        "push and turnkv modes: a prefill engine's NIXL side channel, ENGINE_ID@HOST:PORT, in "
        "--prefill order", repeat=True))
    decode_nixl: list[str] = field(default_factory=list, metadata=cli(
        "turnkv mode: a decode engine's side channel, ENGINE_ID@HOST:PORT, in --decode order",
        repeat=True))
    decoder_kv_ttl: float = field(default=120.0, metadata=cli(
        "bidirectional mode: seconds the decode engines hold a finished turn "
        "(their decoder_kv_blocks_ttl)"))
    # The decode engine holds the session's history.
    short_delta_tokens: int = field(default=SHORT_DELTA_TOKENS, metadata=cli(
        "turnkv mode: a turn adding at most this many tokens to its session is computed on "
        "the decode engine alone (0: never)"))
    # None: short deltas stay on the decode engine whatever its load (router/modes/itl.py).
    itl_target_ms: float | None = field(default=None, metadata=cli(
        "turnkv mode: a target for the inter-token latency of the requests a turn's prompt "
        "computation stalls, in ms: the planner refuses a placement estimated to stall an "
        "engine's other requests longer while one within it exists; with --fixed-pools, while "
        "the decode engine has other requests in flight, a short delta estimated to stall them "
        "longer (its tokens x the engine's measured prefill cost per token; before a "
        "measurement, any) is computed by the prefill engine instead, and 0 keeps short deltas "
        "to an idle decode engine (default: off)", load=float))
    engine_leases: bool = field(default=False, metadata=cli(
        "affinity mode: the engines run the turnkv connector; tell each the session's lease "
        "with every turn (its TTL, priority and expected return; `final` releases it)"))
    # The P/D form: prefill engines compute prompts, decode engines decode (router/modes/turnkv.py);
    # without it the planner places each turn (router/planner.py).
    fixed_pools: bool = field(default=False, metadata=cli(
        "turnkv mode: keep the engines in fixed pools, the prefill engines computing every "
        "prompt and the decode engines decoding (for different hardware per pool); without "
        "it each session has a home on either engine and the router decides per turn where "
        "it runs and what moves"))
    transfer_tokens_per_ms: float = field(default=50.0, metadata=cli(
        "turnkv mode: tokens of KV per ms the engines move between them, for the planner's "
        "estimates (the engines report what a transfer moved, not how long it took)"))
    # A diagnostic: turns placed as told, not as the costs say (router/planner.py).
    pin_placement: str | None = field(default=None, metadata=cli(
        "turnkv mode, diagnostics only: place each session's turns as this comma-separated "
        "list says (whole; split; move, pulling the history; move-copy, to the other "
        "engine's copy of it, pulling where there is none; move-tier, to the other engine, "
        "which reads the history from the shared tier), its first turn as the first "
        "entry and so on, cycling, whatever the costs say"))
    shared_tier: bool = field(default=False, metadata=cli(
        "turnkv mode: the engines share a tier below their caches (the launcher's file tier): "
        "the planner may move a session to another engine, which reads its history from "
        "that tier, rather than have its turn wait behind the home's"))
    no_landing_holds: bool = field(default=False, metadata=cli(
        "turnkv mode, for ablation: send every prompt at once, even onto an engine where a "
        "turn that moves KV has not landed yet (by default a prompt that would hold it longer "
        "than it waits for it waits: router/landings.py)"))
    pair_pool: bool = field(default=False, metadata=cli(
        "turnkv mode: the pair as one pool: each session lives on one engine of its pair, "
        "which serves its turns whole (no KV moves; the pair holds twice the histories, and a "
        "long delta is computed beside other sessions' decoding); for memory pressure"))
    # None: admission off, every turn goes to the engines at once (`admission.Admission`).
    admission_tokens: int | None = field(default=None, metadata=cli(
        "tokens of session history the engines hold together (their KV caches and any tier "
        "below them): a new session's first turn waits while the live sessions' histories, "
        "and its own estimated as their mean, would exceed it (default: off)", load=int))
    admission_max_wait_s: float = field(default=120.0, metadata=cli(
        "seconds a turn waits for admission at most; then it goes anyway"))
    no_inferred_sessions: bool = field(default=False, metadata=cli(
        "turns that no session key names (chat, Responses, Messages) are one-off turns: do "
        "not recognise the conversations they continue from their content (docs/protocol.md, "
        "\"Conversations nobody tagged\")"))
    # None: this router's memory only.
    redis_url: str | None = field(default=None, metadata=cli(
        "share sessions with other routers through this Redis server, redis://HOST:PORT/DB "
        "or unix:///PATH?db=DB", flag="--redis", env="TURNKV_REDIS_URL"))
    # The Responses API's stored responses (`previous_response_id`, GET), per tenant: in Redis
    # with --redis, else in this router's memory (router/responses_store.py).
    responses_max_count: int = field(default=10_000, metadata=cli(
        "stored Responses API responses a tenant keeps; past it, its oldest go first"))
    responses_max_bytes: int = field(default=256 * 1024 * 1024, metadata=cli(
        "bytes of stored Responses API responses (each holds its whole conversation) a "
        "tenant keeps; past it, its oldest go first"))
    responses_ttl: float = field(default=24 * 3600.0, metadata=cli(
        "seconds a stored Responses API response lasts"))

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(ROUTER_MODES)}")
        LeasePolicy(self.default_ttl, self.max_ttl)  # out of range: ValueError
        if self.engine_read_timeout <= 0:
            raise ValueError("engine_read_timeout must be positive")
        if self.short_delta_tokens < 0:
            raise ValueError("short_delta_tokens must be non-negative")
        if self.itl_target_ms is not None and not self.itl_target_ms >= 0:
            raise ValueError("itl_target_ms must be non-negative")
        if self.mode == "affinity" and (not self.engine or self.prefill or self.decode):
            raise ValueError("affinity mode needs --engine URL (aggregated engines), and no "
                             "--prefill or --decode")
        if self.mode != "affinity" and self.engine:
            raise ValueError(f"--engine is for affinity mode; {self.mode} mode needs --prefill "
                             "and --decode")
        if self.mode != "affinity" and (not self.prefill or not self.decode):
            raise ValueError("the router needs at least one prefill and one decode engine")
        if self.mode == "push" and len(self.prefill_nixl) != len(self.prefill):
            raise ValueError("push mode needs --prefill-nixl ENGINE_ID@HOST:PORT for every "
                             "prefill engine")
        if self.mode == "turnkv" and (len(self.prefill_nixl) != len(self.prefill)
                                      or len(self.decode_nixl) != len(self.decode)):
            raise ValueError("turnkv mode needs --prefill-nixl and --decode-nixl "
                             "ENGINE_ID@HOST:PORT for every engine")
        if min(self.responses_max_count, self.responses_max_bytes) < 1 \
                or not self.responses_ttl > 0:
            raise ValueError("the Responses API's store needs positive bounds")
        if self.admission_tokens is not None and self.admission_tokens <= 0:
            raise ValueError("admission_tokens must be positive")
        if not self.admission_max_wait_s > 0:
            raise ValueError("admission_max_wait_s must be positive")
        if self.pair_pool and self.mode != "turnkv":
            raise ValueError("--pair-pool is for turnkv mode")
        if self.fixed_pools and self.mode != "turnkv":
            raise ValueError("--fixed-pools is for turnkv mode")
        if self.shared_tier and self.mode != "turnkv":
            raise ValueError("--shared-tier is for turnkv mode")
        if self.no_landing_holds and self.mode != "turnkv":
            raise ValueError("--no-landing-holds is for turnkv mode")
        if not self.transfer_tokens_per_ms > 0:
            raise ValueError("transfer_tokens_per_ms must be positive")
        pins = self.pins()
        if pins and (self.mode != "turnkv" or self.fixed_pools or self.pair_pool):
            raise ValueError("--pin-placement is for turnkv mode's planner (not with "
                             "--fixed-pools or --pair-pool)")
        tenants = set(self.api_keys.values()) if self.api_keys else {DEFAULT_TENANT}
        for tenant in self.tenant_caps:
            if tenant not in tenants:
                raise ValueError(f"--tenant-caps: there is no tenant {tenant!r} (tenants are "
                                 "named in --api-keys)")
            self.caps_for(tenant)  # out of range: ValueError

    def pins(self) -> tuple[Choice, ...]:
        """The placements `pin_placement` names, in order (empty: none pinned)."""
        if not self.pin_placement:
            return ()
        names = tuple(n.strip() for n in self.pin_placement.split(","))
        wrong = [n for n in names if n not in CHOICES]
        if wrong:
            raise ValueError(f"--pin-placement: {', '.join(wrong)}: choose among "
                             f"{', '.join(CHOICES)}")
        return cast(tuple[Choice, ...], names)

    def caps_for(self, tenant: str) -> TenantCaps:
        """What `tenant`'s clients may ask (router/tenants.py): its own caps, the defaults
        for what they leave out."""
        default = TenantCaps(
            default_max_priority(bool(self.api_keys)) if self.max_priority is None
            else self.max_priority, self.min_next_turn_in)
        return replace(default, **self.tenant_caps.get(tenant, {}))


def itl_target_args(target_ms: float | None) -> tuple[str, ...]:
    """The router's arguments for `itl_target_ms` (`turnkv up` and `turnkv bench` pass it on
    in `ClusterConfig.router_args`); none for None, which is off."""
    return () if target_ms is None else ("--itl-target-ms", repr(float(target_ms)))


def _options() -> list[tuple[Field[Any], Option]]:
    return [(f, f.metadata["cli"]) for f in fields(RouterConfig) if "cli" in f.metadata]


def _flag(f: Field[Any], option: Option) -> str:
    return option.flag or "--" + f.name.replace("_", "-")


def help_for(name: str, with_default: bool = False) -> str:
    """A setting's help (and its default)."""
    f = next(f for f, _ in _options() if f.name == name)
    option: Option = f.metadata["cli"]
    text = option.help
    if with_default and f.default is not MISSING and f.default is not None:
        text += f" (default: {f.default})"
    if option.env:
        text += f" (or {option.env})"
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    types = get_type_hints(RouterConfig)
    for f, option in _options():
        kind = types[f.name]
        if kind is bool:
            parser.add_argument(_flag(f, option), dest=f.name, action="store_true",
                                help=help_for(f.name))
            continue
        parser.add_argument(
            _flag(f, option), dest=f.name, help=help_for(f.name, with_default=True),
            metavar=_flag(f, option)[2:].replace("-", "_").upper(),
            action="append" if option.repeat else "store",
            required=option.repeat and f.default_factory is MISSING,
            type=kind if kind in (int, float) else str,
            choices=ROUTER_MODES if f.name == "mode" else None)


def from_args(args: argparse.Namespace) -> RouterConfig:
    """The settings `add_arguments` parsed; those not given take their defaults."""
    given: dict[str, Any] = {}
    for f, option in _options():
        value = getattr(args, f.name)
        if not value and option.env:
            value = os.environ.get(option.env) or None
        if value is None:
            continue
        given[f.name] = option.load(value) if option.load else value
    return RouterConfig(**given)
