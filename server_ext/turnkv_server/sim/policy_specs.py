"""Policies to compare, as the command line names them:
`ROUTING[:EVICTION][+tier][+shared][@P:D]`.

- ROUTING: affinity (pooled engines), standard (P/D) or turnkv (pairs, the planner);
- EVICTION: lru or lease (default: lease under turnkv, lru otherwise);
- `+tier`: a host tier below each engine's cache (`--tier-tokens`);
- `+shared`: a tier each pair of engines shares below those, of no bound (the launcher's file
  tier);
- `@P:D`: standard's prefill:decode ratio (default 1:1), the fleet's engines split so.

`affinity`, `standard@1:3`, `turnkv+tier`, `turnkv+tier+shared`, `affinity:lease+tier`,
`turnkv:lru`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from turnkv_server.sim.fleet import ROUTINGS, FleetSpec, RoutingName
from turnkv_server.sim.kv_cache import EVICTION_ORDERS, EvictionOrder


def parse_policy(text: str, base: FleetSpec, tier_tokens: int) -> FleetSpec:
    rest, _, ratio = text.partition("@")
    rest, *extras = rest.split("+")
    routing, _, eviction = rest.partition(":")
    if routing not in ROUTINGS:
        raise ValueError(f"policy {text!r}: routing must be one of {', '.join(ROUTINGS)}")
    if eviction and eviction not in EVICTION_ORDERS:
        raise ValueError(f"policy {text!r}: eviction must be one of "
                         f"{', '.join(EVICTION_ORDERS)}")
    if set(extras) - {"tier", "shared"} or len(set(extras)) < len(extras):
        raise ValueError(f"policy {text!r}: only +tier and +shared may follow, once each")
    tier = "tier" in extras
    if tier and tier_tokens <= 0:
        raise ValueError(f"policy {text!r} needs --tier-tokens")
    prefill = base.prefill_engines
    if ratio:
        if routing != "standard":
            raise ValueError(f"policy {text!r}: a P:D ratio is standard's only")
        try:
            p, d = (int(x) for x in ratio.split(":"))
        except ValueError as e:
            raise ValueError(f"policy {text!r}: the ratio is P:D, as 1:3") from e
        prefill = max(1, min(base.engines - 1, round(base.engines * p / (p + d))))
    elif routing == "standard":
        prefill = max(1, base.engines // 2)
    return replace(base, routing=cast(RoutingName, routing),
                   eviction=cast(EvictionOrder, eviction) if eviction else None,
                   tier_tokens=tier_tokens if tier else 0, shared_tier="shared" in extras,
                   prefill_engines=prefill)


DEFAULT_POLICIES = ("affinity", "standard", "turnkv")
