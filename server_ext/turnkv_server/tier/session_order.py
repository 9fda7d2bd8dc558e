"""The host tier's eviction order by the sessions' own hints: a cache policy for vLLM's
`CPUOffloadingManager` (``"eviction_policy": "SessionOrderPolicy", "cache_policy_module_path":
"turnkv_server.tier.session_order"``).

vLLM's tier evicts least recently used chunks first (upstream `cpu/policies/lru.py`). A session
that said when it comes back (the SDK's `next_turn_in`, which the router forwards to the engines
in each request's `kv_transfer_params`) knows better: what saves a recompute is the KV of the
session due back soonest. So the tier orders its chunks as the turnkv connector orders its
leases (`connector/leases.py`):

1. chunks whose last request ended its session (`release`: the client's `final`) go first:
   nothing will ask for them again;
2. then whichever comes back later of: the least recently used chunk without a hint, which is
   expected back at its TTL horizon (its last use plus the request's lease TTL, else
   `DEFAULT_TTL_S`), and the hinted chunk expected back last (its last use plus the hint),
   lowest priority first among equals.

Un-hinted chunks are ordered by last use among themselves (LRU, as vLLM's policy): by their
horizons alone, with equal TTLs, the most recently used would go first. A client without hints
gets vLLM's LRU unchanged.

A chunk's order is set by the last request that used it (its `kv_transfer_params` then): every
turn of a session sends its whole history, so the session's latest turn touches all of its
chunks. Each choice costs O(log n) (three heaps with lazy invalidation: an entry is current
while its key is evictable and its use has not changed since it was pushed).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from typing_extensions import override
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from turnkv_server.connector.settings import ConnectorSettings
from turnkv_server.engine.protocol import BadParams, parse

# The connector's default lease: how long an un-hinted session is assumed to stay interesting.
DEFAULT_TTL_S = ConnectorSettings.lease_ttl_s

_RELEASED, _UNHINTED, _HINTED = 0, 1, 2


@dataclass(frozen=True)
class _Use:
    """How a chunk was last used, and so where it stands in the order."""

    rank: int  # the policy's use counter at the time: recency, and the entry's version
    kind: int
    due: float  # when it is expected back: hinted, or at the horizon
    priority: int


class SessionOrderPolicy(CachePolicy):
    def __init__(self, cache_capacity: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(cache_capacity)
        self._clock = clock
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._uses: dict[OffloadKey, _Use] = {}
        self._evictable: set[OffloadKey] = set()
        self._released: list[tuple[int, OffloadKey]] = []
        self._unhinted: list[tuple[int, OffloadKey]] = []
        self._hinted: list[tuple[float, int, int, OffloadKey]] = []
        self._rank = 0

    # -- uses ------------------------------------------------------------------------------

    def _use(self, keys: Iterable[OffloadKey], req_context: ReqContext | None) -> None:
        kind, due_in, priority = _order_of(req_context)
        now = self._clock()
        for key in keys:
            if key not in self.chunks:
                continue
            self._rank += 1
            use = _Use(self._rank, kind, now + due_in, priority)
            self._uses[key] = use
            if key in self._evictable:
                self._push(key, use)
        self._compact()

    def _push(self, key: OffloadKey, use: _Use) -> None:
        if use.kind == _RELEASED:
            heapq.heappush(self._released, (use.rank, key))
        elif use.kind == _UNHINTED:
            heapq.heappush(self._unhinted, (use.rank, key))
        else:
            heapq.heappush(self._hinted, (-use.due, use.priority, use.rank, key))

    def _current(self, key: OffloadKey, rank: int) -> bool:
        use = self._uses.get(key)
        return key in self._evictable and use is not None and use.rank == rank

    def _compact(self) -> None:
        """Rebuild the heaps once stale entries outnumber the live ones."""
        if len(self._released) + len(self._unhinted) + len(self._hinted) < max(
                64, 3 * len(self._evictable)):
            return
        self._released, self._unhinted, self._hinted = [], [], []
        for key in self._evictable:
            self._push(key, self._uses[key])

    # -- vLLM's CachePolicy ----------------------------------------------------------------

    @override
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    @override
    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self.chunks[key] = chunk
        self._rank += 1
        self._uses[key] = _Use(self._rank, _UNHINTED, self._clock() + DEFAULT_TTL_S, 0)
        if chunk.ref_cnt == 0:
            self.mark_evictable(key)

    @override
    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._uses.pop(key, None)
        self._evictable.discard(key)

    @override
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # Head to tail: the tail (the newest blocks) ends up the most recent, as in vLLM's LRU.
        self._use(reversed(list(keys)), req_context)

    @override
    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]],
                            insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        del insertion_only_keys, reused_keys
        self._use(reversed(order_request_keys(key_groups, req_context)), req_context)

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        self._push(key, self._uses[key])

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    @override
    def clear(self) -> None:
        self.chunks.clear()
        self._uses.clear()
        self._evictable.clear()
        self._released, self._unhinted, self._hinted = [], [], []

    @override
    def evict(self, n: int, protected: set[OffloadKey]
              ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        chosen: list[OffloadKey] = []
        # (heap, entry): protected, or chosen now; back on their heaps when this ends.
        skipped: list[tuple[list, tuple]] = []
        while len(chosen) < n:
            key = self._next_victim(protected, skipped)
            if key is None:
                break
            chosen.append(key)
        for heap, entry in skipped:
            heapq.heappush(heap, entry)
        if len(chosen) < n:
            self._evictable.update(chosen)  # atomic: nothing changed
            return None
        out = []
        for key in chosen:
            out.append((key, self.chunks.pop(key)))
            self._uses.pop(key)
            self._evictable.discard(key)
        self._compact()
        return out

    def _next_victim(self, protected: set[OffloadKey],
                     skipped: list[tuple[list, tuple]]) -> OffloadKey | None:
        released = self._top(self._released, protected, skipped)
        if released is not None:
            return self._take(self._released, skipped)
        unhinted = self._top(self._unhinted, protected, skipped)
        hinted = self._top(self._hinted, protected, skipped)
        if unhinted is None and hinted is None:
            return None
        if hinted is None or (unhinted is not None
                              and self._uses[unhinted].due >= self._uses[hinted].due):
            return self._take(self._unhinted, skipped)
        return self._take(self._hinted, skipped)

    def _top(self, heap: list, protected: set[OffloadKey],
             skipped: list[tuple[list, tuple]]) -> OffloadKey | None:
        """The current, unprotected key at the top of `heap`, left there; stale entries are
        dropped, protected ones set aside (pushed back when the eviction ends)."""
        while heap:
            entry = heap[0]
            key, rank = entry[-1], entry[-2]
            if not self._current(key, rank):
                heapq.heappop(heap)
            elif key in protected:
                skipped.append((heap, heapq.heappop(heap)))
            else:
                return key
        return None

    def _take(self, heap: list, skipped: list[tuple[list, tuple]]) -> OffloadKey:
        """Pop the top of `heap` (checked by `_top`) as a victim; it goes back if the eviction
        as a whole fails."""
        entry = heapq.heappop(heap)
        skipped.append((heap, entry))
        key: OffloadKey = entry[-1]
        # Not evictable while chosen, so that a later `_top` skips its other entries.
        self._evictable.discard(key)
        return key


def _order_of(req_context: ReqContext | None) -> tuple[int, float, int]:
    """(kind, seconds until expected back, priority) from the request's turnkv params."""
    try:
        params = parse(req_context.kv_transfer_params if req_context else None)
    except BadParams:
        params = None  # the connector refuses the request; its blocks count as un-hinted
    if params is None:
        return _UNHINTED, DEFAULT_TTL_S, 0
    if params.release:
        return _RELEASED, 0.0, params.priority
    if params.next_turn_in_s is not None:
        return _HINTED, params.next_turn_in_s, params.priority
    return _UNHINTED, params.ttl_s or DEFAULT_TTL_S, params.priority
