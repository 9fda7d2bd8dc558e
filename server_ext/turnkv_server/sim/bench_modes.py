"""The bench's modes as the simulator's routings, on two engines: `affinity`,
`affinity-offload` and `bound` pooled engines, `standard` P/D, `turnkv` (and `turnkv-tier`,
`turnkv-own-tier`) a pair under the planner. Modes not named here (other P/D variants, single
engines, the ablations) have no routing of their own in the simulator."""

from __future__ import annotations

from turnkv_server.sim.fleet import RoutingName

BENCH_ROUTINGS: dict[str, RoutingName] = {
    "affinity": "affinity",
    "affinity-offload": "affinity",
    "bound": "affinity",
    "standard": "standard",
    "turnkv": "turnkv",
    "turnkv-tier": "turnkv",
    "turnkv-own-tier": "turnkv",
    "turnkv-no-hold": "turnkv",
}
