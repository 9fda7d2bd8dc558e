"""One engine's KV cache (or one host tier) of sessions' histories, with an eviction order.

Sessions are held by tokens (whole blocks), not per block: a session's turn needs its history
as a prefix, and eviction takes an idle session's tail first (vLLM frees a request's blocks
tail first), so what stays is always a prefix. A session is *active* while a turn of it runs
here (its blocks are in use, never evicted) and *idle* between turns.

Two orders for the idle sessions:
- `lru`: vLLM's prefix cache, least recently used first;
- `lease`: turnkv's connector. An idle session holds a lease (`connector.leases.LeaseTable`,
  imported: expected return latest first, then priority, then least recent use; pinned leases
  capped at the connector's share of the cache). Sessions without one (over the cap, expired,
  released) sit in vLLM's free blocks, least recently used, and go before any leased one.

A shared prefix (a system prompt many sessions start with, `share`) is cached once however
many sessions hold it, as vLLM's prefix cache keeps one copy of a block by its hash: each
session's hold counts it, and the cache credits back every copy but one.

A lease's blocks are stood in for by `granule`-token units, so that a 24k-token history costs
the lease table a few dozen IDs, not thousands; the cap counts them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

from turnkv_server.connector.leases import LeaseLimits, LeaseTable

EvictionOrder = Literal["lru", "lease"]
EVICTION_ORDERS: tuple[EvictionOrder, ...] = ("lru", "lease")
# At most this many lease units per cache.
_MAX_UNITS = 64


class SessionKvCache:
    def __init__(self, capacity_tokens: int, block_size: int, order: EvictionOrder,
                 clock: Callable[[], float], limits: LeaseLimits | None = None) -> None:
        if capacity_tokens < block_size:
            raise ValueError("a cache needs room for at least one block")
        self.capacity = capacity_tokens // block_size * block_size
        self.block = block_size
        self.order = order
        self.used = 0
        self.evicted_tokens = 0
        self.lease_evictions = 0  # leased histories lost for room (the planner's `pressure`)
        self._active: dict[str, int] = {}
        self._idle: dict[str, int] = {}
        self._free_lru: OrderedDict[str, None] = OrderedDict()  # idle, unleased: oldest first
        self._granule = max(block_size, -(-self.capacity // _MAX_UNITS) // block_size * block_size)
        self._leases = LeaseTable(max(1, self.capacity // self._granule), limits, clock) \
            if order == "lease" else None
        self._ids: dict[str, int] = {}
        self._next_id = itertools.count()
        self._shares: dict[str, tuple[str, int]] = {}  # session: (prefix, its whole blocks)

    # -- what is held ------------------------------------------------------------------------

    def held(self, session: str) -> int:
        return self._idle.get(session, 0) or self._active.get(session, 0)

    def __contains__(self, session: object) -> bool:
        return session in self._idle or session in self._active

    @property
    def free(self) -> int:
        return self.capacity - self.used + self._shared_copies()

    def share(self, session: str, prefix: str, tokens: int) -> None:
        """The session's first `tokens` are the shared prefix `prefix`."""
        self._shares[session] = (prefix, self._blocks_down(tokens))

    def _shared_copies(self) -> int:
        """Tokens held more than once: each shared prefix's blocks in every session holding
        all of them, but one."""
        if not self._shares:
            return 0
        holders: dict[str, int] = {}
        size: dict[str, int] = {}
        for session, (prefix, tokens) in self._shares.items():
            if tokens and self.held(session) >= tokens:
                holders[prefix] = holders.get(prefix, 0) + 1
                size[prefix] = tokens
        return sum(size[p] * (n - 1) for p, n in holders.items())

    # -- a turn ------------------------------------------------------------------------------

    def begin(self, session: str) -> int:
        """A turn of the session starts here: what it holds (tokens) is in use until `end`."""
        if session in self._active:
            return self._active[session]
        tokens = self._idle.pop(session, 0)
        self._unorder(session)
        self._active[session] = tokens
        return tokens

    def reserve(self, session: str, tokens: int, force: bool = False) -> bool:
        """Grow the active session's hold to `tokens` (its prompt and output), evicting idle
        sessions; False (nothing changed) if even all of them would not make room, unless
        `force`: then it takes what room there is and goes over."""
        tokens = self._blocks(tokens)
        have = self._active.get(session, 0)
        need = tokens - have
        if need > 0 and not self._make_room(need):
            if not force:
                return False
            self._make_room(min(need, self.free + sum(self._idle.values())))
        self._active[session] = max(tokens, have)
        self.used += max(0, need)
        return True

    def end(self, session: str, tokens: int, next_turn_in_s: float | None,
            final: bool = False, lease: bool = True) -> None:
        """The turn ended: the session keeps `tokens` (at most what it reserved) idle here,
        under a lease unless `lease` is False (the blocks of a prompt computed for another
        engine: in vLLM's free blocks, still cached, first to go)."""
        have = self._active.pop(session, 0)
        keep = min(self._blocks_down(tokens), have)
        self.used -= have - keep
        if keep:
            self._idle[session] = keep
            self._order(session, next_turn_in_s, final or not lease)

    def put(self, session: str, tokens: int, next_turn_in_s: float | None,
            final: bool = False) -> int:
        """Store a copy of the session's first `tokens` tokens (a push back, a tier write),
        evicting others for room; returns the tokens newly written (0: no room, or held)."""
        tokens = self._blocks_down(tokens)
        if session in self._active:
            return 0
        have = self._idle.get(session, 0)
        if tokens <= have:
            self._unorder(session)
            self._order(session, next_turn_in_s, final)
            return 0
        self._unorder(session)
        self._idle.pop(session, None)
        self.used -= have
        if not self._make_room(tokens):
            self.evicted_tokens += have
            return 0
        self._idle[session] = tokens
        self.used += tokens
        self._order(session, next_turn_in_s, final)
        return tokens - have

    def drop(self, session: str) -> None:
        """Forget the session here (its turn moved elsewhere, or it ended)."""
        tokens = self._idle.pop(session, 0) + self._active.pop(session, 0)
        self.used -= tokens
        self._unorder(session)
        self._ids.pop(session, None)
        self._shares.pop(session, None)

    def clear(self) -> None:
        """The engine is gone, and its cache with it."""
        for session in list(self._idle) + list(self._active):
            self.drop(session)

    # -- the order ---------------------------------------------------------------------------

    def _order(self, session: str, next_turn_in_s: float | None, final: bool) -> None:
        leases = self._leases
        if leases is None or final:
            # vLLM frees a released request's blocks: they go first (turnkv), or as LRU does.
            self._free_lru[session] = None
            if leases is not None:
                self._free_lru.move_to_end(session, last=False)
            return
        units = -(-self._idle[session] // self._granule)
        base = self._ids.setdefault(session, next(self._next_id)) * (_MAX_UNITS + 1)
        released = leases.pin(session, range(base, base + units),
                              next_turn_in_s=next_turn_in_s)
        for lease in released.leases:
            if lease.session_id != session or session not in leases:
                self._free_lru[lease.session_id] = None  # over the cap: into the free blocks
        self._expire()

    def _unorder(self, session: str) -> None:
        self._free_lru.pop(session, None)
        if self._leases is not None and session in self._leases:
            self._leases.release(session)

    def _expire(self) -> None:
        assert self._leases is not None
        for lease in self._leases.expire().leases:
            self._free_lru[lease.session_id] = None

    def _make_room(self, need: int) -> bool:
        if need > self.free + sum(self._idle.values()):
            return False
        while self.free < need:
            if not self._idle:
                return False  # what the shared prefix saved went with the evicted
            if self._leases is not None:
                self._expire()
            if not self._free_lru:
                assert self._leases is not None  # LRU keeps every idle session in _free_lru
                victim = self._leases.evict(reason="pressure").leases
                self.lease_evictions += 1
                self._free_lru[victim[0].session_id] = None
                self._free_lru.move_to_end(victim[0].session_id, last=False)
            session = next(iter(self._free_lru))
            take = min(self._idle[session], self._blocks(need - self.free))
            self._idle[session] -= take
            self.used -= take
            self.evicted_tokens += take
            if not self._idle[session]:
                del self._idle[session]
                del self._free_lru[session]
                self._ids.pop(session, None)
        return True

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block) * self.block

    def _blocks_down(self, tokens: int) -> int:
        return tokens // self.block * self.block
