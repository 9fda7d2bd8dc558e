"""The `affinity` mode: aggregated engines (no P/D split, prefix caching on, no KV connector)
behind the router, each session kept on one engine, whose prefix cache holds its history from
one turn to the next. No KV moves anywhere. It is what a platform deploys instead of P/D
(session-affinity routing in front of ordinary engines), so it is the baseline every P/D mode
is measured against first.

Placement is the pool's (`upstream.EnginePool`, aggregated): a session stays on its engine
while it is healthy and not overloaded, a new one goes where its prefix ID is warm, else to
the least loaded engine; an engine that fails moves its sessions, like a pair in the P/D modes.

The engine serves every turn alone, as a turnkv decode engine serves a short delta, so the
turn's stats name it as `decode_node`, with `prefill_node` null, and its usage splits the prompt
into `decode_cached` and `decode_computed`. The router does not tokenize the prompt: an
affinity router that did would cost this baseline a request per turn that session-affinity
routers do not make. So the session keeps no token history here, and `prefix_break_at` stays
null (the engine's prefix cache finds the shared prefix by itself).
"""

from __future__ import annotations

from turnkv_server.router.modes.base import DecodeAlone, Mode, Turn, TurnPlan
from turnkv_server.router.placement import Placement


class Affinity(Mode):
    affinity = True

    async def plan(self, turn: Turn, placement: Placement) -> TurnPlan:
        # No kv_transfer_params: the engines have no connector, and nothing is sent or kept.
        # `held` False: nothing here judges whether an engine lost a session's KV.
        return TurnPlan(placement, prefill_params=None,
                        alone=DecodeAlone(None, new_tokens=0, held=False))
