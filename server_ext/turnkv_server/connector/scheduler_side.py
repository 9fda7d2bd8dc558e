"""The connector's scheduler half: leases on this engine's blocks and what to move for whom.

Runs in vLLM's engine-core thread (scheduler callbacks, and the engine's own calls into the
block pool); it owns the block pool's extra references (`holds`) and decides, per request:

- receive: the prompt tokens a peer holds beyond this engine's own prefix hit are loaded
  asynchronously into blocks registered with the peer under the router's transfer ID
  (`ReceiveOrder`), with a digest of their tokens (from token 0) that the sender checks.
  Nothing to fetch, or quarantined blocks over their cap: the peer is told so (`decline`).
  An aborted request cancels its receive (`cancels`); vLLM keeps its blocks until the worker
  reports the receive over. A receive given up while the sender might still write is
  quarantined: its blocks are held out of use (`holds`) until the worker says no write can
  land (`settled`). The reply counts the tokens whose received KV vLLM kept: not those it
  loaded through another connector or computes again (the last one of a whole prompt);
- send: when the request ends normally (stopped, length-capped, or stopped on repetition) its
  blocks stay allocated (delay-free) until the worker has written them to whichever engine
  registers the transfer ID, or gives up (`SendOrder`, with all its token IDs). Any other end
  (aborted, error...) leaves KV that may stop short of what the receiver asked for: the send
  is refused and the receiver recomputes. From the moment the request arrives, the worker
  knows it is coming (`ExpectOrder`, with its prompt);
- stream: while a request whose send is marked `stream` computes its prompt, each step names
  the blocks it completes, so that the worker can write them layer by layer as the model
  computes them, if the receiver has registered already (`StreamOrder`);
- lease: when the request ends its blocks are held for its session by reference, which costs
  the engine no steps; the next turn's prompt hits them as ordinary prefix-cache blocks
  (`session_leases`: renewals, releases, and requests of a session's ended life).

Held blocks are invisible to vLLM's admission, so `room` gives leases back: before a waiting
request is matched, after each step (a free block per running request), when a running
request cannot grow (`has_pending_block_frees`: yes only if blocks went back to the pool) and
after a step that scheduled nothing while a request that could run lacks blocks. A lease never
makes a request wait. When leases are not enough, sends no receiver has
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
from dataclasses import replace
from typing import Any

from turnkv_server.connector.holds import BlockHolder, BlockPool, release_leases_before_reset
from turnkv_server.connector.identity import token_digest
from turnkv_server.connector.idle_expiry import IdleExpiry
from turnkv_server.connector.leases import LeaseLimits, LeaseTable
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
from turnkv_server.connector.session_leases import SessionLeases
from turnkv_server.connector.settings import ConnectorSettings
from turnkv_server.connector.stats import SchedulerCounters
from turnkv_server.connector.tracked import TrackedRequest
from turnkv_server.engine.protocol import KEY, BadParams, TurnParams, TurnReply, parse

log = logging.getLogger(__name__)

# vLLM's finish statuses after which a request's KV covers every token it was asked for
# (upstream's push connector sends after the first two only; a repetition stop is an ordinary
# stop). Anything else (aborted, error, ignored) may have stopped mid-prompt.
NORMAL_FINISH = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"})


class SchedulerSide:
    def __init__(self, block_size: int, policy: LeaseLimits | None = None,
                 max_quarantined_fraction: float = ConnectorSettings.max_quarantined_fraction
                 ) -> None:
        """`max_quarantined_fraction`: the share of the cache above which quarantined blocks
        stop new receives."""
        if not 0 <= max_quarantined_fraction <= 1:
            raise ValueError("max_quarantined_fraction must be in [0, 1]")
        self.block_size = block_size
        self.policy = policy or LeaseLimits()
        self.max_quarantined_fraction = max_quarantined_fraction
        self.holder: BlockHolder | None = None
        self.room: Room | None = None
        self.sessions: SessionLeases | None = None
        self._tracked: dict[str, TrackedRequest] = {}
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
        # vLLM keeps one block as its null block; the caps are shares of the usable ones.
        usable = max(1, total_blocks - 1)
        self.holder = BlockHolder(pool, LeaseTable(usable, self.policy),
                                  int(usable * self.max_quarantined_fraction))
        self.room = Room(self.holder, self._sends, self.block_size, self._abandon)
        self.sessions = SessionLeases(self.holder, self._count)
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
        self._tracked[request.request_id] = TrackedRequest(params, request.num_prompt_tokens)
        if params.send is not None:
            prompt = tuple(request.all_token_ids[:request.num_prompt_tokens])
            self._orders.expects.append(ExpectOrder(params.send.transfer_id, prompt))
        for transfer_id in params.abandon:
            self._abandon(transfer_id)
        self._expire()
        self._session_leases().arrived(params)
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
        # Quarantined blocks cannot come back early: over their cap, no receive starts (the
        # request computes its prompt), so that they cannot take the cache.
        tracked.over_quarantine = self._holder().quarantine_full
        if tracked.over_quarantine:
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
        # What vLLM loads through this connector: none when another connector beside it won the
        # request, or its partial-tail rule kept a local hit.
        tracked.external_tokens = max(0, num_external_tokens)
        if num_external_tokens <= 0:
            self._orders.declines.append((receive.transfer_id, receive.peer))
            self._count("receives_declined_quarantine" if tracked.over_quarantine
                        else "transfers_declined")
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
        if tracked is not None and not tracked.scheduled:
            tracked.first_scheduled(computed_tokens)  # the reply's received tokens
        if tracked is None or tracked.params.send is None or not tracked.params.send.stream:
            return
        done, restart = tracked.completed_blocks(new_blocks, replace, computed_tokens,
                                                 scheduled_tokens, self.block_size)
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
        held = self._session_leases().ended(params, block_ids)
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
            # Under MultiConnector the report is every connector's: another's failed load
            # is neither our quarantine nor our failed receive.
            if ours is not None and request_id in quarantined:
                self._holder().quarantine(request_id, blocks)
            if tracked is not None and ours is not None and (
                    bool(failed_blocks and blocks & failed_blocks) or request_id in quarantined):
                tracked.receive_failed = True
        if quarantined:
            self._gauges()
            # Reported after the step's orders set the alarm: an idle engine must still wake
            # to hear the quarantine settle.
            self._arm()

    def settled(self, request_ids: set[str]) -> None:
        """No late write can reach these requests' quarantined blocks any more."""
        for request_id in request_ids:
            self._holder().settle(request_id)
        self._gauges()
        self._arm()

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
        room = self._room()
        if scheduled_tokens is not None and room.for_stuck_step(scheduled_tokens):
            self._gauges()
        if room.for_running():
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

    def _session_leases(self) -> SessionLeases:
        self._holder()
        assert self.sessions is not None
        return self.sessions

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
