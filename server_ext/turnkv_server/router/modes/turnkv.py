"""What the `turnkv` mode adds to a turn served whole on its home (`modes.planned.Turnkv`,
which `PdTurnkv` extends): KV moved between the pair's engines (the P/D machinery), the forms
that skip the planner, the prefetch before a hinted return, and the session's leases renewed
and released between turns. docs/architecture.md ("The P/D form") tells the whole path; per turn:

1. plan: a planner's `split` (or a `move` that pulls) is the P/D plan with the other engine as
   prefill engine: prefill and decode go out together under one transfer ID, the prefill engine
   writes the blocks the decode engine lacks, layer by layer, and a prompt sent after it to
   either engine waits for it where it would wait longer for that prompt (`router.landings`).
   With `--fixed-pools` every turn is (`_plan_pd`), but a short delta (at most
   `short_delta_tokens` new tokens, by the decode engine's /tokenize), which the decode engine
   computes alone unless the ITL target (`modes.itl`) says its other requests cannot wait, and
   every turn while no prefill engine is up (`--pair-pool`: the home serves each turn whole).
2. finish, after a whole reply: the decode engine keeps the turn's blocks, and the router
   pushes the history back to the other engine (a one-token request that receives them)
   during the agent's tool time, where the planner asked for it (always, with fixed pools).
   Both engines hold the session's blocks under its lease; `final` and DELETE release them,
   hints between turns renew them (`hinted`).

A send whose receiver will not come (a cut stream, an empty output, a refused request, an
ended session) is given up at once (`TurnParams.abandon`). Misses back off (`planned.Backoff`):
a decode engine that lost a short delta's history skips short deltas, and a push back whose
receive failed stops push backs to that engine, for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from turnkv.protocol import CacheHints, FallbackReason
from turnkv_server.engine.protocol import (
    BadParams,
    Receive,
    Send,
    TurnParams,
    parse_reply,
)
from turnkv_server.engine.requests import one_token_request
from turnkv_server.router.decisions import Decision, TurnFacts
from turnkv_server.router.engines import Engine, EngineConnectionError, Placement, Reply
from turnkv_server.router.modes.base import (
    DecodeAlone,
    ModeContext,
    Turn,
    TurnEnd,
    TurnPlan,
    gives_token_ids,
    tokenize,
)
from turnkv_server.router.modes.engine_orders import EngineOrders
from turnkv_server.router.modes.itl import ItlTarget
from turnkv_server.router.modes.planned import (
    HELD_TAIL_TOKENS,
    Turnkv,
    engine_ttl,
    lease_key,
    prefetch_lease,
    turn_hints,
)
from turnkv_server.router.planner import tokens_to_compute
from turnkv_server.router.sessions import Session
from turnkv_server.router.token_history import common_prefix_len

log = logging.getLogger(__name__)

# The next turn waits this long for the previous push back to land on the prefill engine.
PUSH_BACK_WAIT_S = 5.0
PUSH_BACK_TIMEOUT_S = 120.0
# The decode engine's blocks are ready when the push back starts: a peer silent this long is
# gone, and the prefill engine recomputes.
PUSH_BACK_RECEIVE_S = 10.0


def new_tokens(prompt_ids: list[int], history: list[int]) -> int:
    """Tokens of the prompt past its first difference from the session's history (the last
    turn's prompt and output): an edited history counts from the edit."""
    return len(prompt_ids) - common_prefix_len(prompt_ids, history)


def lost_history(computed: int | None, delta: int) -> bool:
    """Whether a decode engine that computed `computed` prompt tokens for a short delta of
    `delta` tokens had lost the session's KV (None: its usage did not say)."""
    return computed is not None and computed > delta + HELD_TAIL_TOKENS


class PdTurnkv(Turnkv):
    """The `turnkv` mode, whole: the class the registry makes."""

    def __init__(self, ctx: ModeContext) -> None:
        super().__init__(ctx, EngineOrders(ctx, wait_before_renewal_s=PUSH_BACK_TIMEOUT_S))
        self._itl = ItlTarget(ctx.itl_target_ms)
        names = [e.name for e in ctx.pool.engines()] if ctx.pool is not None else []
        missing = [name for name in names if name not in ctx.side_channels]
        if missing:
            raise ValueError(f"turnkv mode needs the side channel (HOST:PORT) of every engine; "
                             f"missing: {', '.join(missing)}")

    # -- before the turn (`begin` is `Turnkv`'s) ----------------------------------------------

    async def _plan_unplanned(self, turn: Turn, placement: Placement) -> TurnPlan:
        session = turn.session
        if not (self.ctx.pair_pool and session is not None):
            return await self._plan_pd(turn, placement)
        # The pair as one pool: the session's home serves the turn alone, under the session's
        # lease, computing what its cache and tier do not hold; nothing is kept for a push
        # back. The prompt is not tokenized, as in `affinity` (a `/tokenize` round trip per
        # turn waits behind the engine's own work: docs/benchmarks.md), so the stats read as
        # an aggregated engine's, and what the engine computed tells nothing (`held` False).
        session.mode_state.model = turn.body.get("model")
        other = self._other(placement.decode)
        home = self._homes.home(session, placement, [other] if other is not None else [])
        return TurnPlan(Placement(home, home, placement.reason), prefill_params=None,
                        decode_params=self._params(turn),
                        alone=DecodeAlone(None, new_tokens=0, held=False))

    async def _plan_pd(self, turn: Turn, placement: Placement) -> TurnPlan:
        session = turn.session
        if session is not None:
            # Releasing the session's leases when it ends takes a request of its model.
            session.mode_state.model = turn.body.get("model")
        # The decode engine keeps the turn for the push back, unless there is nothing to keep,
        # or nobody to keep it for (a push back to a prefill engine that is down is refused),
        # or no history to push back over (an API whose route returns no token IDs).
        keep = (session is not None and not turn_hints(turn).final and placement.prefill.healthy
                and not self._no_push_back.active(placement.prefill.name)
                and gives_token_ids(turn))
        decode_send = transfer_id(turn, "d2p") if keep else None
        alone, diverted = await self._short_delta(turn, placement)
        note: tuple[FallbackReason, str] | None = None
        if alone is None and not placement.prefill.healthy:
            alone = await self._without_prefill(turn, placement)
            note = ("engine_unavailable", f"{placement.prefill.name} is down: "
                    f"{placement.decode.name} computed the prompt alone")
        if alone is not None:
            return TurnPlan(placement, prefill_params=None, alone=alone,
                            decode_params=self._params(turn, send=send_or_none(decode_send)),
                            decode_send=decode_send, reuse_note=note)
        await self._settle_push_back(session)
        p2d = transfer_id(turn, "p2d")
        # Streamed: the decode engine registers within milliseconds, so the prefill's KV can be
        # written layer by layer while it computes.
        prefill = self._params(turn, send=Send(p2d, stream=True))
        decode = self._params(turn, send=send_or_none(decode_send), receive=Receive(
            p2d, self.ctx.side_channels[placement.prefill.name]))
        return TurnPlan(placement, prefill_params=prefill, concurrent=True,
                        decode_params=decode, prefill_send=p2d, decode_send=decode_send,
                        note=diverted)

    async def _short_delta(self, turn: Turn, placement: Placement
                           ) -> tuple[DecodeAlone | None, str | None]:
        """The decode engine serves the turn alone if it holds the session's history, the
        prompt adds at most `short_delta_tokens` to it and, with an ITL target, computing
        them there keeps its other requests within it (else: why not, for the stats)."""
        session = turn.session
        decode = placement.decode
        if (self.ctx.short_delta_tokens <= 0 or session is None or not session.tokens
                or session.decode != decode.name or self._pressure.active(decode.name)):
            return None, None
        prompt_ids = await tokenize(self.ctx.upstream, decode, turn)
        if prompt_ids is None:
            return None, None
        delta = new_tokens(prompt_ids, session.tokens)
        if delta > self.ctx.short_delta_tokens:
            return None, None
        # Read after /tokenize has ended: this turn's own requests are not in the count; only a
        # prefill engine that is up can take the delta. No target: the policy is never entered.
        if self.ctx.itl_target_ms is not None and placement.prefill.healthy:
            tokens = tokens_to_compute(len(prompt_ids), len(prompt_ids) - delta,
                                       decode.block_size)
            diverted = self._itl.divert(decode.name, tokens, others=decode.in_flight)
            if diverted is not None:
                return None, diverted
        return DecodeAlone(prompt_ids, delta), None

    async def _without_prefill(self, turn: Turn, placement: Placement) -> DecodeAlone:
        """No prefill engine is up (placement names a healthy one whenever there is one): the
        decode engine computes the prompt, but for what it holds of the session, as a single
        engine would. Otherwise every turn that is not a short delta (every session's first)
        would get 503 until a prefill engine is back, while the decode engine sits idle."""
        session = turn.session
        held = bool(session is not None and session.tokens
                    and session.decode == placement.decode.name)
        prompt_ids = await tokenize(self.ctx.upstream, placement.decode, turn)
        if prompt_ids is None:
            # Its API renders no prompt alone: the engine's usage counts it, and nothing
            # judges whether it held the history (`held` False).
            return DecodeAlone(None, new_tokens=0, held=False)
        history = session.tokens if session is not None and held else []
        return DecodeAlone(prompt_ids, new_tokens(prompt_ids, history), held=held)

    async def _move_kv(self, turn: Turn, decision: Decision, prompt_ids: list[int] | None,
                       facts: TurnFacts, placement: Placement) -> TurnPlan:
        if decision.where != "whole" and self.ctx.landing_holds:  # later prompts may wait
            self._landings.begin(id(turn), decision)
        home, prefill = self._engine(decision.home), self._engine(decision.prefill)
        # A push back names its receiver as the placement's prefill engine (`_finish_pd`
        # sends it there): the engine that computed a split, else the home's other engine.
        receiver = (prefill if prefill is not home else self._other(home)) \
            if decision.push_back else None
        keep = transfer_id(turn, "d2p") if receiver is not None else None
        decode_params = self._params(turn, send=send_or_none(keep))
        old = self.ctx.pool.named.get(turn.session.decode or "") \
            if self.ctx.pool and turn.session else None
        if decision.where == "split" or (decision.where == "move" and not decision.pull
                                         and old is not None and old.healthy):
            # From the other engine's copy, which the last push back may still be writing.
            await self._settle_push_back(turn.session)
        if prefill is not home:  # a split, or a move that pulls
            p2d = transfer_id(turn, "p2d")
            decode_params = self._params(turn, send=send_or_none(keep), receive=Receive(
                p2d, self.ctx.side_channels[prefill.name]))
            return TurnPlan(Placement(prefill, home, placement.reason),
                            prefill_params=self._params(turn, send=Send(p2d, stream=True)),
                            concurrent=True, decode_params=decode_params, prefill_send=p2d,
                            decode_send=keep, decision=decision)
        # Whole, kept for a push back, or a move that recomputes: the home alone.
        held = prompt_ids is not None and facts.home_holds > 0 and decision.where == "whole"
        alone = DecodeAlone(prompt_ids, len(prompt_ids) - facts.home_holds if prompt_ids
                            else 0, held=held)
        return TurnPlan(Placement(receiver or home, home, placement.reason),
                        prefill_params=None, alone=alone, decode_params=decode_params,
                        decode_send=keep, decision=decision)

    async def _settle_push_back(self, session: Session | None) -> None:
        if session is None or session.mode_state.push_back is None:
            return
        task, session.mode_state.push_back = session.mode_state.push_back, None
        if not task.done():
            # A turn that comes before the push back has landed computes what it lacks.
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), PUSH_BACK_WAIT_S)

    # -- after it ----------------------------------------------------------------------------

    def prefilled(self, turn: Turn) -> None:
        self._landings.prefilled(id(turn))  # a split's helper, or a pull's old home, is done

    def _finish_pd(self, turn: Turn, plan: TurnPlan, end: TurnEnd) -> None:
        prefill, decode = plan.placement.prefill, plan.placement.decode
        model = turn.body.get("model")
        if end.how == "refused":
            # The decode engine refused a body the prefill engine took: it never registers.
            self._orders.abandon(prefill, model, plan.prefill_send)
            return
        if end.how == "cut":
            # No push back after a cut (one that finished just before it would wait the timeout).
            self._orders.abandon(decode, model, plan.decode_send)
            if not turn.output_token_ids:
                # Cut before any token: the decode engine may never have registered for the
                # prefill engine's send (a request dropped before it reached the engine).
                self._orders.abandon(prefill, model, plan.prefill_send)
            return
        self._schedule_prefetch(turn, plan)
        if plan.alone is not None and plan.alone.held and end.stats is not None:
            computed = end.stats.prompt_tokens.decode_computed
            self._judge_short_delta(decode.name, plan.alone.new_tokens, computed)
            if (self.ctx.itl_target_ms is not None
                    and plan.alone.new_tokens <= self.ctx.short_delta_tokens
                    and not lost_history(computed, plan.alone.new_tokens)):
                # A short delta that found its history: what the ITL target's estimate is
                # about (a recomputed history, or a long delta while the prefill engine was
                # down, would count a long prompt's cost per token).
                self._itl.observe(decode.name, end.stats.times.engine_prefill_ms, computed)
        if plan.decode_send is None or turn.session is None:
            return  # the decode request had nothing to send
        if turn.prompt_token_ids is None or not turn.output_token_ids:
            # No history to push back: the decode engine's send would wait for nothing.
            self._orders.abandon(decode, model, plan.decode_send)
            return
        history = [*turn.prompt_token_ids, *turn.output_token_ids]
        receive = Receive(plan.decode_send, self.ctx.side_channels[decode.name],
                          # The decode engine never computed its last token's KV.
                          peer_tokens=len(history) - 1, timeout_s=PUSH_BACK_RECEIVE_S)
        # The same cache salt: block hashes include it, and without it the history lands in
        # another cache.
        request = one_token_request(model, history, self._params(turn, receive=receive),
                                    cache_salt=turn.body.get("cache_salt"))
        turn.session.mode_state.push_back = self._orders.spawn(
            self._push_back(prefill, decode, request, plan.decode_send))

    def _schedule_prefetch(self, turn: Turn, plan: TurnPlan) -> None:
        """After a whole reply, a hinted pause ahead: the turn's engines make the history
        resident shortly before the session is back (a prefill engine's copy arrives with
        the push back)."""
        hints = turn_hints(turn)
        if turn.session is None or hints.final or hints.next_turn_in is None:
            return
        prefill, decode = plan.placement.prefill, plan.placement.decode
        self._prefetches.schedule(
            turn.session.key, [decode] if prefill is decode else [prefill, decode], turn,
            prefetch_lease(turn.session, hints, self.ctx.session_policy), hints.next_turn_in,
            pays=self._prefetch_pays)

    def _prefetch_pays(self, engine: Engine) -> bool:
        """Where the sessions the engine is home to fit its cache and, under the planner,
        only where it lost a held history lately. Elsewhere the history is still resident: the
        prefetch is only a request the turn may wait for; and where the homes' histories do
        not fit, it makes one resident by evicting another's, which that turn then restores."""
        if self.planned and not self._pressure.active(engine.name):
            return False
        room = self._holdings.room(engine.name, engine.kv_tokens)
        return room is None or room > 0

    # -- between turns -----------------------------------------------------------------------

    def drop_session(self, session: Session) -> None:
        place = self._places.get(session.key)
        copy_on = place.copy_on if place is not None else None
        if copy_on is not None and copy_on not in (session.prefill, session.decode):
            # The copy an earlier turn left on an engine the last turn did not name: the
            # session is ending, so naming it releases its lease with the rest.
            session.prefill = copy_on
        self.forget_session(session)
        task, session.mode_state.push_back = session.mode_state.push_back, None
        if task is not None and not task.done():
            # Its own ending gives the decode engine's send up (`_push_back`).
            task.cancel()
        model = session.mode_state.model
        pool = self.ctx.pool
        if pool is None or model is None:
            return
        release = TurnParams(session=lease_key(session), release=True, epoch=session.epoch)
        orders = [(engine, release) for engine in pool.engines()
                  if engine.name in (session.prefill, session.decode) and engine.healthy]
        self._orders.spawn(self._orders.tell(model, orders))

    def hinted(self, session: Session, hints: CacheHints) -> None:
        """Hints between turns: each engine holding the session's lease renews it (the
        session's TTL, priority and expected return) with a renew-only request: the decode
        engine now, the prefill engine once the push back in flight has landed (it replaces
        that engine's lease with the turn's, hints and all). A turn in flight pins new
        leases with its own hints when it ends: nothing to renew."""
        model, pool = session.mode_state.model, self.ctx.pool
        if hints.final or session.in_flight or model is None or pool is None:
            return
        params = TurnParams(session=lease_key(session), renew_only=True, epoch=session.epoch,
                            ttl_s=engine_ttl(self.ctx.session_policy, hints),
                            priority=session.priority, next_turn_in_s=hints.next_turn_in)
        landing = session.mode_state.push_back
        for engine in pool.engines():
            if engine.healthy and engine.name in (session.prefill, session.decode):
                after = landing if engine.name == session.prefill else None
                self._orders.spawn(self._orders.renew(engine, model, params, after))
        self._prefetches.rescheduled(
            session.key, hints.next_turn_in,
            prefetch_lease(session, hints, self.ctx.session_policy))

    def _judge_short_delta(self, decode: str, delta: int, computed: int | None) -> None:
        """A short delta that found its history gone backs that decode engine off short
        deltas; one that found it held ends the backoff."""
        backoff = None if computed is None else self._pressure.record(
            decode, lost_history(computed, delta))
        if backoff is not None:
            log.info("%s recomputed %d tokens for a delta of %d: its turns skip short deltas "
                 "for %.0f s", decode, computed, delta, backoff)

    async def _push_back(self, prefill: Engine, decode: Engine, request: dict[str, Any],
                         transfer_id: str) -> None:
        """Send the history to the prefill engine, which registers for the decode engine's
        blocks; if it does not (refused, e.g. a history at the model's max length, failed,
        unreachable, or cancelled), the decode engine's send is given up. The next turn
        recomputes what is missing."""
        landed = False
        try:
            reply = await self.ctx.upstream.post(prefill, "/v1/completions", request,
                                                 timeout=PUSH_BACK_TIMEOUT_S)
            landed = reply.ok
            failed = _receive_failed(reply) if reply.ok else None
            backoff = None if failed is None else self._no_push_back.record(prefill.name, failed)
            if backoff is not None:
                log.info("a push back to %s recomputed the history (its receive failed): turns "
                         "keep nothing to push back to it for %.0f s", prefill.name, backoff)
            if not reply.ok:
                log.warning("push back to %s answered %s: %s", prefill.name, reply.status,
                            reply.content[:200])
        except EngineConnectionError as exc:
            log.warning("push back to %s failed: %s", prefill.name, exc)
        finally:
            if not landed:
                self._orders.abandon(decode, request.get("model"), transfer_id)


def transfer_id(turn: Turn, direction: str) -> str:
    return f"{turn.request_id}-{direction}"


def send_or_none(transfer_id: str | None) -> Send | None:
    return Send(transfer_id) if transfer_id is not None else None


def _receive_failed(reply: Reply) -> bool | None:
    """Whether the engine's reply says its receive failed (None: it does not say)."""
    try:
        figures = parse_reply(reply.json().get("kv_transfer_params"))
    except (ValueError, AttributeError, BadParams):
        return None
    return None if figures is None else figures.receive_failed
