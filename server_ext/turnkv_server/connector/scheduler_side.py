"""The connector's scheduler half: leases on this engine's blocks and what to move for whom.

Runs in vLLM's engine-core thread, from scheduler callbacks only (CONNECTOR-NOTES.md, "Callback
order"); it owns the block pool's extra references (`holds`) and decides, per request:

- receive: the prompt tokens a peer holds beyond this engine's own prefix hit are loaded
  asynchronously; the request's blocks for them are registered with the peer under the
  router's transfer ID (`ReceiveOrder`). Nothing to fetch: the peer is told so (`decline`).
- send: when the request ends its blocks stay allocated (delay-free) until the worker has
  written them to whichever engine registers the transfer ID, or gives up (`SendOrder`).
- stream: while a request that will send computes its prompt, each step names the blocks it
  completes, so that the worker can write them layer by layer as the model computes them, if
  the receiver has registered already (`StreamOrder`);
- lease: when the request ends its blocks are held for its session by reference, which costs
  the engine no steps; the next turn's prompt hits them as ordinary prefix-cache blocks.

Held blocks are invisible to vLLM's admission, so room is made here: before a waiting request
is matched (`make_room` for its missing blocks) and when a running request cannot grow
(`has_pending_block_frees`, one lease at a time). A lease never makes a request wait. When
leases are not enough, sends that no receiver has registered for yet are abandoned (their
receivers recompute): otherwise two engines whose caches are full of blocks kept for each
other wait on each other until the transfers time out.

The worker learns its orders through `StepOrders`, one per scheduler step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnkv_server.connector.holds import BlockHolder, BlockPool
from turnkv_server.connector.leases import LeasePolicy, LeaseTable
from turnkv_server.connector.params import BadParams, TurnParams, parse

log = logging.getLogger(__name__)

# Lazy expiry runs at most this often; a held block past its TTL is harmless until then.
EXPIRY_CHECK_S = 0.5


class Request(Protocol):
    """The part of vLLM's `Request` read here."""

    @property
    def request_id(self) -> str: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class ReceiveOrder:
    request_id: str
    transfer_id: str
    peer: str
    blocks: list[int]
    first_block: int
    timeout_s: float | None = None


@dataclass(frozen=True)
class SendOrder:
    request_id: str
    transfer_id: str
    blocks: list[int]


@dataclass(frozen=True)
class StreamOrder:
    """This step completes `blocks` ((index in the request, block ID) pairs) of a request whose
    KV goes to `transfer_id`'s receiver. `restart`: the request was preempted and recomputes."""

    transfer_id: str
    blocks: list[tuple[int, int]]
    restart: bool = False


@dataclass
class StepOrders:
    receives: list[ReceiveOrder] = field(default_factory=list)
    sends: list[SendOrder] = field(default_factory=list)
    declines: list[tuple[str, str]] = field(default_factory=list)  # (transfer_id, peer)
    # Transfers this engine was to send but has no blocks for (the request never ran).
    refusals: list[str] = field(default_factory=list)
    # Sends to give up if nobody has registered for them yet: their blocks are needed here.
    abandons: list[str] = field(default_factory=list)
    streams: list[StreamOrder] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.receives or self.sends or self.declines or self.refusals
                    or self.abandons or self.streams)


@dataclass
class _Tracked:
    params: TurnParams
    prompt_tokens: int = 0
    # The request's block IDs as its steps were scheduled (sending requests only).
    blocks: list[int] | None = None
    local_tokens: int = 0
    external_tokens: int = 0
    receive_done: bool = False
    receive_failed: bool = False


class SchedulerSide:
    def __init__(self, block_size: int, policy: LeasePolicy | None = None) -> None:
        self.block_size = block_size
        self.policy = policy or LeasePolicy()
        self.holder: BlockHolder | None = None
        self._tracked: dict[str, _Tracked] = {}
        # Requests whose blocks a peer is still writing, with those blocks: vLLM frees them
        # when the receive ends.
        self._receiving: dict[str, frozenset[int]] = {}
        self._orders = StepOrders()
        self._stats: dict[str, Any] = {}
        self._released_seen: dict[str, int] = {}
        # Delay-freed requests waiting for their send, oldest first: request ID ->
        # (transfer ID, blocks, abandoned).
        self._sending: dict[str, tuple[str, int, bool]] = {}

    def bind(self, pool: BlockPool, total_blocks: int) -> None:
        # vLLM keeps one block as its null block; the cap is a share of the usable ones.
        self.holder = BlockHolder(pool, LeaseTable(max(1, total_blocks - 1), self.policy))

    # -- callbacks ---------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        try:
            params = parse(request.kv_transfer_params)
        except BadParams as exc:
            log.warning("turnkv: request %s: %s; served without the connector",
                        request.request_id, exc)
            params = None
        if params is None:
            return
        self._tracked[request.request_id] = _Tracked(params, request.num_prompt_tokens)
        holder = self._holder()
        self._expire()
        if params.session is None:
            return
        if params.release:
            holder.release(params.session)
        elif holder.leases.renew(params.session, ttl_s=params.ttl_s, priority=params.priority):
            self._count("lease_hits")
        else:
            self._count("lease_misses")

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self._tracked.get(request.request_id)
        session = tracked.params.session if tracked else None
        missing = request.num_tokens - num_computed_tokens
        self._make_room(math.ceil(missing / self.block_size) + 1,
                        keep=[session] if session else [])
        if tracked is None or tracked.params.receive is None or tracked.receive_done:
            return 0, False
        receive = tracked.params.receive
        available = request.num_prompt_tokens
        if receive.peer_tokens is not None:
            available = min(available, receive.peer_tokens)
        external = max(0, available - num_computed_tokens)
        tracked.local_tokens = num_computed_tokens
        tracked.external_tokens = external
        return external, external > 0

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or tracked.params.receive is None or tracked.receive_done:
            return
        # Once per request: a preempted request recomputes rather than asking twice.
        tracked.receive_done = True
        receive = tracked.params.receive
        if num_external_tokens <= 0:
            self._orders.declines.append((receive.transfer_id, receive.peer))
            self._count("transfers_declined")
            return
        first = tracked.local_tokens // self.block_size
        last = math.ceil((tracked.local_tokens + num_external_tokens) / self.block_size)
        self._orders.receives.append(ReceiveOrder(
            request.request_id, receive.transfer_id, receive.peer,
            list(block_ids[first:last]), first, receive.timeout_s))
        self._receiving[request.request_id] = frozenset(block_ids[first:last])
        self._count("tokens_requested", num_external_tokens)

    def scheduled(self, request_id: str, new_blocks: Sequence[int], replace: bool,
                  computed_tokens: int, scheduled_tokens: int) -> None:
        """The step being built computes `scheduled_tokens` tokens of the request from
        `computed_tokens` on, with `new_blocks` added to its blocks (or, `replace`, as all
        of them: a new or resumed request). Emits the blocks the step completes."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.params.send is None:
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

    def request_finished(self, request: Request, block_ids: Sequence[int],
                         session_id: str | None = None) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        params = tracked.params
        holder = self._holder()
        delay_free = False
        if request.request_id in self._receiving:
            # Aborted while its KV was still arriving: vLLM keeps the request until the receive
            # ends and then frees its blocks; they hold nothing worth keeping or sending.
            del self._receiving[request.request_id]
            if params.send is not None:
                self._orders.refusals.append(params.send.transfer_id)
            return False, None
        if params.send is not None and block_ids:
            self._orders.sends.append(SendOrder(request.request_id, params.send.transfer_id,
                                                list(block_ids)))
            self._sending[request.request_id] = (params.send.transfer_id, len(block_ids), False)
            delay_free = True
        elif params.send is not None:
            self._orders.refusals.append(params.send.transfer_id)
        session = params.session or session_id
        held = 0
        if session is not None and not params.release and block_ids:
            held = holder.hold(session, block_ids, ttl_s=params.ttl_s, priority=params.priority)
            self._count("blocks_held", held)
        self._gauges()
        received = tracked.external_tokens if tracked.receive_done else 0
        reply = {"held_blocks": held, "local_tokens": tracked.local_tokens,
                 "received_tokens": 0 if tracked.receive_failed else received,
                 "receive_failed": tracked.receive_failed}
        return delay_free, {"turnkv": reply}

    def received(self, request_ids: set[str], failed_blocks: set[int] | None = None) -> None:
        """The worker reports these requests' KV arrived, or failed: `failed_blocks` are the
        step's load errors, which vLLM recomputes."""
        for request_id in request_ids:
            blocks = self._receiving.pop(request_id, frozenset())
            tracked = self._tracked.get(request_id)
            if tracked is not None and failed_blocks and blocks & failed_blocks:
                tracked.receive_failed = True

    def sent(self, request_ids: set[str]) -> None:
        """The worker reports these requests' sends ended (written, failed or abandoned)."""
        for request_id in request_ids:
            self._sending.pop(request_id, None)

    def has_pending_block_frees(self) -> bool:
        """A running request cannot grow: give back the least valuable lease, if any."""
        holder = self._holder()
        freed = holder.make_room(holder.pool.get_num_free_blocks() + 1)
        if freed:
            self._gauges()
        return freed > 0

    def build_orders(self) -> StepOrders:
        self._expire()
        orders, self._orders = self._orders, StepOrders()
        return orders

    def take_stats(self) -> dict[str, Any]:
        released = self._holder().leases.released_total if self.holder else {}
        for reason, total in released.items():
            key = {"release": "leases_released", "expired": "leases_expired",
                   "over_cap": "leases_over_cap", "pressure": "leases_pressure"}.get(reason)
            if key is None:
                continue
            delta = total - self._released_seen.get(reason, 0)
            if delta:
                self._count(key, delta)
                self._released_seen[reason] = total
        stats, self._stats = self._stats, {}
        return stats

    # -- internals ---------------------------------------------------------------------------

    def _make_room(self, blocks_needed: int, keep: list[str]) -> None:
        holder = self._holder()
        holder.make_room(blocks_needed, keep=keep)
        short = blocks_needed - holder.pool.get_num_free_blocks()
        for request_id, (transfer_id, blocks, abandoned) in self._sending.items():
            if short <= 0:
                break
            # Blocks already abandoned are on their way back (the worker frees them next step).
            short -= blocks
            if not abandoned:
                self._orders.abandons.append(transfer_id)
                self._sending[request_id] = (transfer_id, blocks, True)

    def _holder(self) -> BlockHolder:
        if self.holder is None:
            raise RuntimeError("the turnkv connector was not bound to a block pool")
        return self.holder

    def _expire(self) -> None:
        if self._holder().expire(EXPIRY_CHECK_S):
            self._gauges()

    def _gauges(self) -> None:
        leases = self._holder().leases
        self._stats["pinned_blocks"] = leases.pinned_blocks
        self._stats["leases"] = len(leases)

    def _count(self, key: str, amount: float = 1) -> None:
        self._stats[key] = self._stats.get(key, 0) + amount
