"""The connector's scheduler half: leases on this engine's blocks and what to move for whom.

Runs in vLLM's engine-core thread (scheduler callbacks, and the engine's own calls into the
block pool); it owns the block pool's extra references (`holds`) and decides, per request:

- receive: the prompt tokens a peer holds beyond this engine's own prefix hit are loaded
  asynchronously; the request's blocks for them are registered with the peer under the
  router's transfer ID (`ReceiveOrder`), with a digest of the tokens they will hold (from
  token 0), which the sender checks against its own. Nothing to fetch: the peer is told so
  (`decline`). A request aborted while its KV arrives cancels the receive (`cancels`): vLLM
  keeps it, and its blocks, until the worker reports the receive over;
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
  steps; the next turn's prompt hits them as ordinary prefix-cache blocks.

Held blocks are invisible to vLLM's admission, so room is made here: before a waiting request
is matched (`make_room` for its missing blocks) and when a running request cannot grow
(`has_pending_block_frees`, which says yes only if blocks really went back to the pool). A
lease never makes a request wait. When leases are not enough, sends that no receiver has
registered for yet are abandoned (their receivers recompute): otherwise two engines whose
caches are full of blocks kept for each other wait on each other until the transfers time
out. The router can also abandon a send it knows nobody will register for (`abandon`).

Leases expire on time on an idle engine too. vLLM's engine core blocks on its input queue when
it has no work, so no callback runs; `has_pending_push_work` (which vLLM asks before blocking)
says yes only while a lease is past its deadline, and a timer thread (`WakeAlarm`) puts a
wake-up message on that queue at the next deadline. The engine then steps once, the step's
`build_orders` frees the lease's blocks, and the engine sleeps again: a lease outlives its TTL
by the timer's latency plus one (empty) step. The timer thread only reads a time; it never
touches the block pool. Without a queue to wake (an in-process engine core, which its caller
steps), expiry runs at the next step.

A prefix-cache reset (new weights, sleep) needs every block free: the bound pool's
`reset_prefix_cache` releases every lease first, and so does `reset_cache`.

The worker learns its orders through `StepOrders`, one per scheduler step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Protocol

from turnkv_server.connector.holds import BlockHolder, BlockPool
from turnkv_server.connector.identity import token_digest
from turnkv_server.connector.leases import LeasePolicy, LeaseTable
from turnkv_server.connector.params import BadParams, TurnParams, parse

log = logging.getLogger(__name__)

# vLLM's finish statuses after which a request's KV covers every token it was asked for
# (upstream's push connector sends after the first two only; a repetition stop is an ordinary
# stop). Anything else (aborted, error, ignored) may have stopped mid-prompt.
NORMAL_FINISH = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"})
# How long an abandon is remembered for a send whose request has not ended (or arrived) yet.
ABANDON_MEMORY_S = 600.0


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
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def status(self) -> Enum: ...


@dataclass(frozen=True)
class ReceiveOrder:
    """Register `blocks` (the request's blocks from index `first_block` on) with `peer` under
    `transfer_id`. Once written they hold the KV of the request's first `tokens` tokens, whose
    `token_digest` is `digest`."""

    request_id: str
    transfer_id: str
    peer: str
    blocks: list[int]
    first_block: int
    timeout_s: float | None
    tokens: int
    digest: bytes


@dataclass(frozen=True)
class ExpectOrder:
    """A request that will send under `transfer_id` has arrived (queued or computing): its
    prompt's token IDs, to check registrations that come before it ends."""

    transfer_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SendOrder:
    """The request finished normally: write `blocks` to whoever registers `transfer_id`.
    `token_ids`: all its tokens (prompt and output)."""

    request_id: str
    transfer_id: str
    blocks: list[int]
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StreamOrder:
    """This step completes `blocks` ((index in the request, block ID) pairs) of a request whose
    KV goes to `transfer_id`'s receiver. `restart`: the request was preempted and recomputes."""

    transfer_id: str
    blocks: list[tuple[int, int]]
    restart: bool = False


@dataclass
class StepOrders:
    expects: list[ExpectOrder] = field(default_factory=list)
    receives: list[ReceiveOrder] = field(default_factory=list)
    sends: list[SendOrder] = field(default_factory=list)
    declines: list[tuple[str, str]] = field(default_factory=list)  # (transfer_id, peer)
    # Transfers this engine was to send but has no (complete) KV for.
    refusals: list[str] = field(default_factory=list)
    # Sends to give up if nobody has registered for them yet: their blocks are needed here,
    # or the router knows nobody will.
    abandons: list[str] = field(default_factory=list)
    # Receives whose request was aborted while its KV was arriving.
    cancels: list[str] = field(default_factory=list)
    streams: list[StreamOrder] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.expects or self.receives or self.sends or self.declines
                    or self.refusals or self.abandons or self.cancels or self.streams)


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


class WakeAlarm:
    """Calls `wake` from its own thread once the monotonic clock reaches the time last `set`
    (one call per time set). It reads nothing else and touches nothing else: the engine-core
    thread, once woken, does the work."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._at = math.inf
        self._closed = False
        self._failed = False
        self._cond = threading.Condition()
        # Started now, inside the engine's start-up, so that it runs where the engine's other
        # threads run (the launcher pins every engine thread to the engine's cores).
        self._thread = threading.Thread(target=self._run, name="turnkv-lease-alarm",
                                        daemon=True)
        self._thread.start()

    def set(self, at: float) -> None:
        with self._cond:
            self._at = at
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (delay := self._at - time.monotonic()) > 0:
                    self._cond.wait(None if delay == math.inf else delay)
                if self._closed:
                    return
                self._at = math.inf  # the engine sets the next deadline once it has stepped
            try:
                self._wake()
            except Exception:  # the engine then expires leases at its next step
                if not self._failed:
                    log.exception("turnkv: could not wake the engine for lease expiry")
                    self._failed = True


class SchedulerSide:
    def __init__(self, block_size: int, policy: LeasePolicy | None = None) -> None:
        self.block_size = block_size
        self.policy = policy or LeasePolicy()
        self.holder: BlockHolder | None = None
        self._tracked: dict[str, _Tracked] = {}
        # Requests whose blocks a peer is still writing: their transfer ID and those blocks.
        # vLLM frees them when the receive ends.
        self._receiving: dict[str, tuple[str, frozenset[int]]] = {}
        self._orders = StepOrders()
        self._stats: dict[str, Any] = {}
        self._released_seen: dict[str, int] = {}
        # Delay-freed requests waiting for their send, oldest first: request ID ->
        # (transfer ID, blocks, abandoned).
        self._sending: dict[str, tuple[str, int, bool]] = {}
        # Sends the router gave up before their request ended, or before it even arrived
        # here (its abandon overtook it in the API server), with when: they refuse.
        self._abandoned_early: dict[str, float] = {}
        self._alarm: WakeAlarm | None = None
        self._armed = math.inf

    def bind(self, pool: BlockPool, total_blocks: int,
             wake: Callable[[], None] | None = None) -> None:
        """Hold leases on `pool`. `wake` (called from another thread) makes an idle engine
        step; without it, leases expire at the engine's next step."""
        # vLLM keeps one block as its null block; the cap is a share of the usable ones.
        self.holder = BlockHolder(pool, LeaseTable(max(1, total_blocks - 1), self.policy))
        self._release_leases_on_reset(pool)
        if self._alarm is not None:
            self._alarm.close()
        self._alarm = WakeAlarm(wake) if wake is not None else None
        self._armed = math.inf

    def close(self) -> None:
        if self._alarm is not None:
            self._alarm.close()
            self._alarm = None

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
            if params.release:
                holder.release(params.session)
            elif holder.leases.renew(params.session, ttl_s=params.ttl_s,
                                     priority=params.priority):
                self._count("lease_hits")
            else:
                self._count("lease_misses")
        self._arm()

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
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        params = tracked.params
        holder = self._holder()
        send = params.send
        abandoned = False
        if send is not None:
            abandoned = self._abandoned_early.pop(send.transfer_id, None) is not None
        receiving = self._receiving.pop(request.request_id, None)
        if receiving is not None:
            # Aborted while its KV was still arriving: vLLM keeps the request until the worker
            # reports the receive over, then frees its blocks; they hold nothing worth keeping
            # or sending. The sender may still be writing: the transport cancels with it first.
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
                self._sending[request.request_id] = (send.transfer_id, len(block_ids), False)
                delay_free = True
            else:
                self._orders.refusals.append(send.transfer_id)
        held = 0
        # Holding an aborted request's blocks is safe: vLLM hashes only full blocks of
        # computed tokens, so the next turn can hit only KV of its own tokens.
        if params.session is not None and not params.release and block_ids:
            held = holder.hold(params.session, block_ids, ttl_s=params.ttl_s,
                               priority=params.priority)
            self._count("blocks_held", held)
        self._gauges()
        self._arm()
        received = tracked.external_tokens if tracked.receive_done else 0
        reply = {"held_blocks": held, "local_tokens": tracked.local_tokens,
                 "received_tokens": 0 if tracked.receive_failed else received,
                 "receive_failed": tracked.receive_failed}
        return delay_free, {"turnkv": reply}

    def received(self, request_ids: set[str], failed_blocks: set[int] | None = None) -> None:
        """The worker reports these requests' KV arrived, or failed: `failed_blocks` are the
        step's load errors, which vLLM recomputes."""
        for request_id in request_ids:
            _, blocks = self._receiving.pop(request_id, ("", frozenset()))
            tracked = self._tracked.get(request_id)
            if tracked is not None and failed_blocks and blocks & failed_blocks:
                tracked.receive_failed = True

    def sent(self, request_ids: set[str]) -> None:
        """The worker reports these requests' sends ended (written, failed or abandoned)."""
        for request_id in request_ids:
            self._sending.pop(request_id, None)

    def has_pending_block_frees(self) -> bool:
        """A running request cannot grow: give back the least valuable leases until a block
        comes back to the pool. True only if one did: vLLM then retries instead of preempting,
        and a lease whose blocks a running request also uses frees nothing."""
        holder = self._holder()
        leases = len(holder.leases)
        freed = holder.make_room(holder.pool.get_num_free_blocks() + 1)
        if len(holder.leases) != leases:
            self._gauges()
            self._arm()
        return freed > 0

    def has_pending_push_work(self) -> bool:
        """Whether the engine must step although it has no request: a lease is past its
        deadline (see the module docstring)."""
        return self.holder is not None and self.holder.leases.due()

    def build_orders(self) -> StepOrders:
        self._expire()
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
        released = self._holder().leases.released_total if self.holder else {}
        for reason, total in released.items():
            key = {"release": "leases_released", "reset": "leases_released",
                   "expired": "leases_expired", "over_cap": "leases_over_cap",
                   "pressure": "leases_pressure"}.get(reason)
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
        leases = len(holder.leases)
        holder.make_room(blocks_needed, keep=keep)
        if len(holder.leases) != leases:
            self._gauges()
            self._arm()
        short = blocks_needed - holder.pool.get_num_free_blocks()
        for transfer_id, blocks, abandoned in list(self._sending.values()):
            if short <= 0:
                break
            # Blocks already abandoned are on their way back (the worker frees them next step).
            short -= blocks
            if not abandoned:
                self._abandon(transfer_id)

    def _abandon(self, transfer_id: str) -> None:
        for request_id, (tid, blocks, abandoned) in self._sending.items():
            if tid == transfer_id:
                # Finished and waiting for a receiver: the transport lets it go.
                if not abandoned:
                    self._sending[request_id] = (tid, blocks, True)
                    self._orders.abandons.append(transfer_id)
                return
        # Its request is still running, or has not arrived yet: it refuses when it ends
        # (and the transport, told now, answers a registration that comes meanwhile).
        now = time.monotonic()
        self._abandoned_early[transfer_id] = now
        while self._abandoned_early:  # oldest first; a send's request comes within seconds
            oldest, at = next(iter(self._abandoned_early.items()))
            if now - at <= ABANDON_MEMORY_S:
                break
            del self._abandoned_early[oldest]
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

    def _release_leases_on_reset(self, pool: BlockPool) -> None:
        """vLLM's `reset_prefix_cache` (the API's, and sleep's) fails while any block is in
        use, and calls the connector's `reset_cache` only after it: wrap the bound pool's, so
        that leases are released first."""
        reset = getattr(pool, "reset_prefix_cache", None)
        if reset is None:
            return
        original = getattr(reset, "turnkv_original", reset)  # bound again: wrap once

        def reset_prefix_cache() -> bool:
            self.reset_cache()
            return bool(original())

        reset_prefix_cache.turnkv_original = original  # type: ignore[attr-defined]
        setattr(pool, "reset_prefix_cache", reset_prefix_cache)  # noqa: B010

    def _holder(self) -> BlockHolder:
        if self.holder is None:
            raise RuntimeError("the turnkv connector was not bound to a block pool")
        return self.holder

    def _expire(self) -> None:
        if self._holder().expire():
            self._gauges()

    def _arm(self) -> None:
        """Tell the alarm the next lease deadline, if it changed."""
        if self._alarm is None or self.holder is None:
            return
        at = self.holder.leases.next_expiry()
        if at != self._armed:
            self._armed = at
            self._alarm.set(at)

    def _gauges(self) -> None:
        leases = self._holder().leases
        self._stats["pinned_blocks"] = leases.pinned_blocks
        self._stats["leases"] = len(leases)

    def _count(self, key: str, amount: float = 1) -> None:
        self._stats[key] = self._stats.get(key, 0) + amount


def _kv_follows_tokens(request: Request) -> bool:
    """Whether the request's KV is a function of its token IDs alone (and the model)."""
    return (getattr(request, "prompt_embeds", None) is None
            and not getattr(request, "mm_features", None)
            and getattr(request, "lora_request", None) is None)
