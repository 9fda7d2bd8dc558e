"""The `affinity` mode: aggregated engines (no P/D split, prefix caching on, no KV connector)
behind the router, each session kept on one engine, whose prefix cache holds its history from
one turn to the next. No KV moves anywhere. It is what a platform deploys instead of P/D
(session-affinity routing in front of ordinary engines), so it is the baseline every P/D mode
is measured against first.

Placement is the pool's (`aggregated.AggregatedPool`): a session stays on its engine
while it is healthy and not overloaded, a new one goes where its prefix ID is warm, else to
the least loaded engine; an engine that fails moves its sessions, like a pair in the P/D modes.

The engine serves every turn alone, as a turnkv decode engine serves a short delta, so the
turn's stats name it as `decode_node`, with `prefill_node` null, and its usage splits the prompt
into `decode_cached` and `decode_computed`. The router does not tokenize the prompt: an
affinity router that did would cost this baseline a request per turn that session-affinity
routers do not make. So the session keeps no token history here, and `prefix_break_at` stays
null (the engine's prefix cache finds the shared prefix by itself).

With `--engine-leases` the engines run the turnkv connector (an aggregated engine has no
peer: no KV moves) and every turn tells its engine the session's lease as turnkv mode tells a
pair (`planned.lease_params`): the engine holds the session's blocks after the turn, orders its
evictions by the session's hints, and with a lower tier below it loads an evicted history back.
"""

from __future__ import annotations

from typing import Any

from turnkv.protocol import CacheHints
from turnkv_server.engine.protocol import TurnParams
from turnkv_server.router.engines import Engine, Placement
from turnkv_server.router.modes.base import (
    DecodeAlone,
    Mode,
    ModeContext,
    Turn,
    TurnEnd,
    TurnPlan,
)
from turnkv_server.router.modes.engine_orders import EngineOrders
from turnkv_server.router.modes.planned import (
    engine_ttl,
    lease_key,
    lease_params,
    prefetch_lease,
    turn_hints,
)
from turnkv_server.router.modes.prefetch import Prefetches
from turnkv_server.router.sessions import Session


class Affinity(Mode):
    affinity = True

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx)
        self._orders = EngineOrders(ctx, wait_before_renewal_s=0.0)
        self._prefetches = Prefetches(ctx.upstream, self._orders)

    async def begin(self, turn: Turn) -> None:
        if self.ctx.engine_leases and turn.session is not None:
            turn.prefetch = await self._prefetches.before_turn(turn.session.key)

    async def plan(self, turn: Turn, placement: Placement) -> TurnPlan:
        # Plain engines get no kv_transfer_params: nothing is sent or kept. `held` False:
        # nothing here judges whether an engine lost a session's KV.
        params = None
        if self.ctx.engine_leases and turn.session is not None:
            turn.session.mode_state.model = turn.body.get("model")
            params = lease_params(turn, self.ctx.session_policy)
        return TurnPlan(placement, prefill_params=None, decode_params=params,
                        alone=DecodeAlone(None, new_tokens=0, held=False))

    def finish(self, turn: Turn, plan: TurnPlan, end: TurnEnd) -> None:
        """A hinted pause ahead: the engine is told to make the history resident shortly
        before the session is back (`prefetch`)."""
        session, hints = turn.session, turn_hints(turn)
        if self.ctx.engine_leases and session is not None and end.how == "complete" \
                and not hints.final:
            self._prefetches.schedule(session.key, [plan.placement.decode], turn,
                                      self._prefetch_lease(session, hints),
                                      hints.next_turn_in)

    def forget_session(self, session: Session) -> None:
        self._prefetches.cancel(session.key)

    def drop_session(self, session: Session) -> None:
        """Its engine's lease ends now rather than at its TTL."""
        self.forget_session(session)
        engine = self._engine_of(session)
        if engine is not None:
            release = TurnParams(session=lease_key(session), release=True, epoch=session.epoch)
            self._orders.spawn(self._orders.tell(session.mode_state.model,
                                                 [(engine, release)]))

    def hinted(self, session: Session, hints: CacheHints) -> None:
        engine, model = self._engine_of(session), session.mode_state.model
        if engine is None or model is None or hints.final or session.in_flight:
            return
        params = TurnParams(session=lease_key(session), renew_only=True, epoch=session.epoch,
                            ttl_s=engine_ttl(self.ctx.session_policy, hints),
                            priority=session.priority, next_turn_in_s=hints.next_turn_in)
        self._orders.spawn(self._orders.renew(engine, model, params, None))
        self._prefetches.rescheduled(session.key, hints.next_turn_in,
                                     self._prefetch_lease(session, hints))

    def _prefetch_lease(self, session: Session, hints: CacheHints) -> dict[str, Any]:
        return prefetch_lease(session, hints, self.ctx.session_policy)

    def _engine_of(self, session: Session) -> Engine | None:
        """The healthy engine holding the session's lease, with `--engine-leases`."""
        pool = self.ctx.pool
        if not self.ctx.engine_leases or pool is None:
            return None
        return next((e for e in pool.engines() if e.name == session.decode and e.healthy),
                    None)
