"""The connector's scheduler half: leases on this engine's blocks and what to move for whom.

Runs in vLLM's engine-core thread (scheduler callbacks, and the engine's own calls into the
block pool); it owns the block pool's extra references (`holds`) and decides, per request:

- receive: the prompt tokens a peer holds beyond this engine's own prefix hit are loaded
  asynchronously into blocks registered with the peer under the router's transfer ID
  (`ReceiveOrder`), with a digest of their tokens (from token 0) that the sender checks.
  Nothing to fetch: the peer is told so (`decline`). An aborted request cancels its receive
  (`cancels`); vLLM keeps its blocks until the worker reports the receive over. A receive
  given up while the sender might still write is quarantined: its blocks are held out of use
  (`holds`) until the worker says no write can land (`settled`);
- send: when the request ends normally (stopped, length-capped, or stopped on repetition) its
  blocks stay allocated (delay-free) until the worker has written them to whichever engine
  registers the transfer ID, or gives up (`SendOrder`, with all its token IDs). Any other end
  (aborted, error...) leaves KV that may stop short of what the receiver asked for: the send
  is refused and the receiver recomputes. From the moment the request arrives, the worker
  knows it is coming (`ExpectOrder`, with its prompt);
- stream: while a request whose send is marked `stream` computes its prompt, each step names
  the blocks it completes, so that the worker can write them layer by layer as the model
  computes them, if the receiver has registered already (`StreamOrder`);
- lease: when the request ends its blocks are held for its session (the router's
  tenant-scoped key, never vLLM's own `session_id`) by reference, which costs the engine no
  steps; the next turn's prompt hits them as ordinary prefix-cache blocks. A `renew_only`
  request (a hint sent between turns) renews the session's lease and holds nothing.

Held blocks are invisible to vLLM's admission, so `room` gives leases back: before a waiting
request is matched, when a running request cannot grow (`has_pending_block_frees`: yes only if
blocks went back to the pool) and after a step that scheduled nothing while a request could
run. A lease never makes a request wait. When leases are not enough, sends no receiver has
registered for yet are abandoned, as the router can ask too (`abandon`; `pending_sends`).
Leases expire on an idle engine too: a timer wakes it at the next deadline (`idle_expiry`). A
prefix-cache reset needs every block free: `reset_prefix_cache` releases every lease first.

The worker learns its orders through `StepOrders` (`orders`), one per scheduler step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from turnkv_server.connector.holds import BlockHolder, BlockPool, release_leases_before_reset
from turnkv_server.connector.identity import token_digest
from turnkv_server.connector.idle_expiry import IdleExpiry
from turnkv_server.connector.leases import LeasePolicy, LeaseTable
from turnkv_server.connector.orders import (
    ExpectOrder,
    ReceiveOrder,
    SendOrder,
    StepOrders,
    StreamOrder,
)
from turnkv_server.connector.pending_sends import PendingSends
from turnkv_server.connector.request_view import Request
from turnkv_server.connector.room import Room
from turnkv_server.connector.stats import SchedulerCounters
from turnkv_server.engine.protocol import KEY, BadParams, TurnParams, TurnReply, parse

log = logging.getLogger(__name__)

# vLLM's finish statuses after which a request's KV covers every token it was asked for
# (upstream's push connector sends after the first two only; a repetition stop is an ordinary
# stop). Anything else (aborted, error, ignored) may have stopped mid-prompt.
NORMAL_FINISH = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"})


@dataclass
class _Tracked:
    params: TurnParams
    prompt_tokens: int = 0
    # The request's block IDs as its steps were scheduled (streaming sends only).
    blocks: list[int] | None = None
    local_tokens: int = 0
    external_tokens: int = 0
    receive_done: bool = False
    receive_failed: bool = False
    # When vLLM gave the request its blocks, and how long a lower tier (vLLM's offloading
    # connector beside this one) then took to load its KV into them.
    allocated_at: float | None = None
    restore_ms: float | None = None


class SchedulerSide:
    def __init__(self, block_size: int, policy: LeasePolicy | None = None) -> None:
        self.block_size = block_size
        self.policy = policy or LeasePolicy()
        self.holder: BlockHolder | None = None
        self.room: Room | None = None
        self._tracked: dict[str, _Tracked] = {}
        # Requests whose blocks a peer is still writing: their transfer ID and those blocks.
        # vLLM frees them when the receive ends.
        self._receiving: dict[str, tuple[str, frozenset[int]]] = {}
        self._orders = StepOrders()
        self._stats = SchedulerCounters()
        self._sends = PendingSends()
        self._expiry = IdleExpiry()

    def bind(self, pool: BlockPool, total_blocks: int,
             wake: Callable[[], None] | None = None) -> None:
        """Hold leases on `pool`. `wake` (called from another thread) makes an idle engine
        step; without it, leases expire at the engine's next step."""
        # vLLM keeps one block as its null block; the cap is a share of the usable ones.
        self.holder = BlockHolder(pool, LeaseTable(max(1, total_blocks - 1), self.policy))
        self.room = Room(self.holder, self._sends, self.block_size, self._abandon)
        # vLLM's prefix-cache reset fails while a block is in use: leases are released first.
        release_leases_before_reset(pool, self.reset_cache)
        self._expiry.bind(wake)

    def close(self) -> None:
        self._expiry.close()

    # -- callbacks ---------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._room().arrived(request)
        try:
            params = parse(request.kv_transfer_params)
        except BadParams as exc:
            log.warning("turnkv: request %s: %s; served without the connector",
                        request.request_id, exc)
            params = None
        if params is None:
            return
        if (params.send or params.receive) and not _kv_follows_tokens(request):
            params = self._without_transfers(request, params)
        self._tracked[request.request_id] = _Tracked(params, request.num_prompt_tokens)
        if params.send is not None:
            prompt = tuple(request.all_token_ids[:request.num_prompt_tokens])
            self._orders.expects.append(ExpectOrder(params.send.transfer_id, prompt))
        for transfer_id in params.abandon:
            self._abandon(transfer_id)
        holder = self._holder()
        self._expire()
        if params.session is not None:
            # A hinted session is back now: this request needs its lease, and the hinted time
            # counts from the request's end (`hold` sets it then). Un-hinted: LRU as ever.
            back_now = None if params.next_turn_in_s is None else 0.0
            if params.release:
                holder.release(params.session)
            elif params.renew_only:
                # A hint between turns: the lease takes its TTL, priority and expected return
                # (counted from now); this request's blocks are not held (`request_finished`).
                renewed = holder.leases.renew(params.session, ttl_s=params.ttl_s,
                                              priority=params.priority,
                                              next_turn_in_s=params.next_turn_in_s)
                self._count("leases_renewed" if renewed else "renewals_missed")
            elif holder.leases.renew(params.session, ttl_s=params.ttl_s,
                                     priority=params.priority, next_turn_in_s=back_now):
                self._count("lease_hits")
            else:
                self._count("lease_misses")
        self._arm()

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self._tracked.get(request.request_id)
        session = tracked.params.session if tracked else None
        if self._room().for_admission(request, num_computed_tokens,
                                      keep=[session] if session else []):
            self._gauges()
            self._arm()
        if tracked is not None:  # the reply's local hit, receiving or not
            tracked.local_tokens = num_computed_tokens
        if tracked is None or tracked.params.receive is None or tracked.receive_done:
            return 0, False
        receive = tracked.params.receive
        available = request.num_prompt_tokens
        if receive.peer_tokens is not None:
            available = min(available, receive.peer_tokens)
        external = max(0, available - num_computed_tokens)
        tracked.external_tokens = external
        return external, external > 0

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None and tracked.allocated_at is None:
            tracked.allocated_at = time.monotonic()
        if tracked is None or tracked.params.receive is None or tracked.receive_done:
            return
        # Once per request: a preempted request recomputes rather than asking twice.
        tracked.receive_done = True
        receive = tracked.params.receive
        if num_external_tokens <= 0:
            self._orders.declines.append((receive.transfer_id, receive.peer))
            self._count("transfers_declined")
            return
        tokens = tracked.local_tokens + num_external_tokens
        first = tracked.local_tokens // self.block_size
        last = math.ceil(tokens / self.block_size)
        self._orders.receives.append(ReceiveOrder(
            request.request_id, receive.transfer_id, receive.peer,
            list(block_ids[first:last]), first, receive.timeout_s,
            tokens, token_digest(request.all_token_ids[:tokens])))
        self._receiving[request.request_id] = (receive.transfer_id,
                                               frozenset(block_ids[first:last]))
        self._count("tokens_requested", num_external_tokens)

    def scheduled(self, request_id: str, new_blocks: Sequence[int], replace: bool,
                  computed_tokens: int, scheduled_tokens: int) -> None:
        """The step being built computes `scheduled_tokens` tokens of the request from
        `computed_tokens` on, with `new_blocks` added to its blocks (or, `replace`, as all
        of them: a new or resumed request). Emits the blocks the step completes."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.params.send is None or not tracked.params.send.stream:
            return
        restart = replace and tracked.blocks is not None
        if replace or tracked.blocks is None:
            tracked.blocks = list(new_blocks)
        else:
            tracked.blocks += new_blocks
        prompt = tracked.prompt_tokens
        start, end = computed_tokens, min(computed_tokens + scheduled_tokens, prompt)
        if start >= end:
            return  # decoding: the prompt's blocks are complete
        size = self.block_size
        done = [(k, tracked.blocks[k])
                for k in range(start // size, (end - 1) // size + 1)
                if min((k + 1) * size, prompt) <= end and k < len(tracked.blocks)]
        if done or restart:
            self._orders.streams.append(StreamOrder(tracked.params.send.transfer_id, done,
                                                    restart))

    def request_finished(self, request: Request, block_ids: Sequence[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._room().left(request.request_id)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        params = tracked.params
        holder = self._holder()
        send = params.send
        abandoned = False
        if send is not None:
            abandoned = self._sends.abandoned_early(send.transfer_id)
        receiving = self._receiving.get(request.request_id)
        if receiving is not None:
            # Aborted while its KV was still arriving: vLLM keeps the request until the worker
            # reports the receive over, then frees its blocks; they hold nothing worth keeping
            # or sending. The sender may still be writing: the transport cancels with it, and
            # `received` quarantines the blocks if it cannot be sure.
            self._orders.cancels.append(receiving[0])
            if send is not None:
                self._orders.refusals.append(send.transfer_id)
            return False, None
        receive = params.receive
        if receive is not None and not tracked.receive_done:
            # Ended before it ever asked for its KV (aborted while waiting): tell the sender,
            # whose finished request would otherwise keep its blocks for the send timeout.
            self._orders.declines.append((receive.transfer_id, receive.peer))
        delay_free = False
        if send is not None:
            if block_ids and request.status.name in NORMAL_FINISH and not abandoned:
                self._orders.sends.append(SendOrder(request.request_id, send.transfer_id,
                                                    list(block_ids), tuple(request.all_token_ids)))
                self._sends.add(request.request_id, send.transfer_id, len(block_ids))
                delay_free = True
            else:
                self._orders.refusals.append(send.transfer_id)
        held = 0
        # Holding an aborted request's blocks is safe: vLLM hashes only full blocks of
        # computed tokens, so the next turn can hit only KV of its own tokens.
        if params.session is not None and not (params.release or params.renew_only) and block_ids:
            held = holder.hold(params.session, block_ids, ttl_s=params.ttl_s,
                               priority=params.priority, next_turn_in_s=params.next_turn_in_s)
            self._count("blocks_held", held)
        self._gauges()
        self._arm()
        received = tracked.external_tokens if tracked.receive_done else 0
        reply = TurnReply(held_blocks=held, local_tokens=tracked.local_tokens,
                          received_tokens=0 if tracked.receive_failed else received,
                          receive_failed=tracked.receive_failed, restore_ms=tracked.restore_ms)
        return delay_free, {KEY: reply.to_wire()}

    def received(self, request_ids: set[str], failed_blocks: set[int] | None = None,
                 quarantined: set[str] | None = None) -> None:
        """The worker reports these requests' KV arrived, or failed: `failed_blocks` are the
        step's load errors, which vLLM recomputes in place; the `quarantined` requests' blocks
        a late write may still reach, so they are held out of use (vLLM frees those requests'
        blocks next and computes their prompts in others) until `settled`."""
        quarantined = quarantined or set()
        for request_id in request_ids:
            ours = self._receiving.pop(request_id, None)
            _, blocks = ours or ("", frozenset())
            tracked = self._tracked.get(request_id)
            if ours is None and tracked is not None and tracked.allocated_at is not None:
                # Not a receive of ours: the tier below loaded it (a step's granularity).
                tracked.restore_ms = (time.monotonic() - tracked.allocated_at) * 1000
            if request_id in quarantined:
                self._holder().quarantine(request_id, blocks)
            if tracked is not None and (bool(failed_blocks and blocks & failed_blocks)
                                        or request_id in quarantined):
                tracked.receive_failed = True
        if quarantined:
            self._gauges()

    def settled(self, request_ids: set[str]) -> None:
        """No late write can reach these requests' quarantined blocks any more."""
        for request_id in request_ids:
            self._holder().settle(request_id)
        self._gauges()

    def sent(self, request_ids: set[str]) -> None:
        """The worker reports these requests' sends ended (written, failed or abandoned)."""
        for request_id in request_ids:
            self._sends.done(request_id)

    def has_pending_block_frees(self) -> bool:
        """A running request cannot grow: give back the least valuable leases until a block
        comes back to the pool. True only if one did: vLLM then retries instead of preempting,
        and a lease whose blocks a running request also uses frees nothing."""
        freed, ended = self._room().for_growth()
        if ended:
            self._gauges()
            self._arm()
        return freed

    def has_pending_push_work(self) -> bool:
        """Whether the engine must step although it has no request: a lease is past its
        deadline, or quarantined blocks are due a check (see `idle_expiry`)."""
        return self.holder is not None and self.holder.due()

    def build_orders(self, scheduled_tokens: int | None = None) -> StepOrders:
        """The step's orders; `scheduled_tokens`: what the step computes (`Room`)."""
        self._expire()
        if scheduled_tokens is not None and self._room().for_stuck_step(scheduled_tokens):
            self._gauges()
        self._holder().stepped()
        self._arm()
        orders, self._orders = self._orders, StepOrders()
        return orders

    def reset_cache(self) -> bool:
        """Release every lease: vLLM resets its prefix cache (new weights, sleep) only when no
        block is in use, and KV computed before a reset must not serve later turns."""
        if self.holder is not None and len(self.holder.leases):
            self.holder.release_all("reset")
            self._gauges()
            self._arm()
        return True

    def take_stats(self) -> dict[str, Any]:
        return self._stats.take(self._holder().leases.released_total if self.holder else {})

    # -- internals ---------------------------------------------------------------------------

    def _abandon(self, transfer_id: str) -> None:
        if self._sends.abandon(transfer_id):
            self._orders.abandons.append(transfer_id)

    def _without_transfers(self, request: Request, params: TurnParams) -> TurnParams:
        # The token digests describe token IDs only: KV that also depends on images, prompt
        # embeddings or an adapter is recomputed rather than moved.
        log.warning("turnkv: request %s: KV that depends on more than token IDs is not "
                    "transferred; it is computed here", request.request_id)
        if params.receive is not None:
            self._orders.declines.append((params.receive.transfer_id, params.receive.peer))
        if params.send is not None:
            self._orders.refusals.append(params.send.transfer_id)
        return replace(params, receive=None, send=None)

    def _holder(self) -> BlockHolder:
        if self.holder is None:
            raise RuntimeError("the turnkv connector was not bound to a block pool")
        return self.holder

    def _room(self) -> Room:
        self._holder()
        assert self.room is not None
        return self.room

    def _expire(self) -> None:
        if self._holder().expire():
            self._gauges()

    def _arm(self) -> None:
        if self.holder is not None:
            self._expiry.arm(self.holder.next_wake())

    def _gauges(self) -> None:
        holder = self._holder()
        self._stats.gauges(pinned_blocks=holder.leases.pinned_blocks, leases=len(holder.leases),
                           quarantined_blocks=holder.quarantined_blocks)

    def _count(self, key: str, amount: float = 1) -> None:
        self._stats.count(key, amount)


def _kv_follows_tokens(request: Request) -> bool:
    """Whether the request's KV is a function of its token IDs alone (and the model)."""
    return (getattr(request, "prompt_embeds", None) is None
            and not getattr(request, "mm_features", None)
            and getattr(request, "lora_request", None) is None)
