"""Session leases on one engine: which KV blocks each session keeps after its turn, until when.

The connector's scheduler side holds a finished turn's blocks by reference (it `touch()`es
them in the block pool) instead of delay-freeing the request, so an engine holding leases goes
idle (vLLM steps without pause while any request is delay-freed). Held blocks are invisible to
vLLM's admission, so the holder must give them back itself: on expiry, on release, when the
pinned blocks pass their cap, and when a new request needs room. This table decides which; it
never touches the block pool. Every method returns the block IDs whose hold ends, and the
caller frees exactly those (one reference each), from a scheduler callback.

The rules follow SGLang's TTL policy and turnkv's session protocol:
- the operator sets a default TTL and a cap; a client's TTL may only shorten the cap;
- a session's next turn replaces its lease (and renews it); `final`, DELETE or expiry end it;
- pinned blocks are capped per engine; over the cap, or when room is needed, the lowest
  priority, least recently used leases go first; a lease never makes a request wait.

One owner of the clock: the table reads `clock()` and nothing else does. Blocks shared by
several leases (a common system prompt) are counted once against the cap, and a lease frees
only its own reference to them.

Two heaps keep every decision logarithmic in the number of leases: one by deadline (what
expires next, and when: the scheduler side wakes an idle engine then) and one by priority
and last use (the next victim). A renewal or a new turn pushes a fresh entry and leaves the
old one behind; an entry counts only while it is its session's latest (lazy invalidation),
and the heaps are rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LeasePolicy:
    """The operator's settings: TTLs in seconds, and the pin cap as a share of the cache."""

    default_ttl_s: float = 300.0
    max_ttl_s: float = 900.0
    max_pinned_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.default_ttl_s <= self.max_ttl_s:
            raise ValueError("lease policy needs 0 < default_ttl_s <= max_ttl_s")
        if not 0 < self.max_pinned_fraction <= 1:
            raise ValueError("max_pinned_fraction must be in (0, 1]")

    def ttl(self, requested_s: float | None) -> float:
        """The client's TTL, or the default; never above the operator's cap."""
        if requested_s is not None and requested_s <= 0:
            raise ValueError(f"a lease TTL must be positive, not {requested_s}")
        return min(requested_s if requested_s is not None else self.default_ttl_s,
                   self.max_ttl_s)


@dataclass(frozen=True)
class Lease:
    """One session's hold: its blocks in prompt order, its priority and its deadline."""

    session_id: str
    blocks: tuple[int, ...]
    priority: int
    expires_at: float
    last_used: float


@dataclass(frozen=True)
class Released:
    """Leases that ended, why, and the block references to free (tail first, per lease)."""

    leases: tuple[Lease, ...] = ()
    reason: str = ""

    @property
    def blocks(self) -> list[int]:
        # Tail first: the end of a prompt is the least likely to be shared by another one.
        return [b for lease in self.leases for b in reversed(lease.blocks)]


class LeaseTable:
    """The leases of one engine with `total_blocks` KV blocks; see the module docstring."""

    def __init__(self, total_blocks: int, policy: LeasePolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total_blocks < 1:
            raise ValueError("total_blocks must be at least 1")
        self.policy = policy or LeasePolicy()
        self.cap_blocks = int(total_blocks * self.policy.max_pinned_fraction)
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        # Heap entries end with (version, session): valid while `_version[session]` matches.
        self._by_deadline: list[tuple[float, int, str]] = []
        self._by_value: list[tuple[int, float, int, str]] = []
        self._version: dict[str, int] = {}
        self._versions = itertools.count()
        # How many leases hold each block: the cap counts distinct blocks.
        self._refs: Counter[int] = Counter()
        self.released_total: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._leases

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._leases))

    def get(self, session_id: str) -> Lease | None:
        return self._leases.get(session_id)

    @property
    def pinned_blocks(self) -> int:
        """Distinct blocks held by any lease: what the leases take from the cache."""
        return len(self._refs)

    def pin(self, session_id: str, blocks: Sequence[int], *, ttl_s: float | None = None,
            priority: int = 0) -> Released:
        """Hold `blocks` for the session (its turn just ended), replacing its previous lease.

        The caller touches `blocks` first, then frees what this returns: the previous lease's
        references, and any leases pushed out by the cap. A lease larger than the cap on its
        own is not kept: its blocks come straight back.
        """
        now = self._clock()
        previous = self._drop(session_id)
        ended = [previous] if previous else []
        lease = Lease(session_id, tuple(blocks), priority, now + self.policy.ttl(ttl_s), now)
        if len(set(lease.blocks)) > self.cap_blocks:
            self.released_total["over_cap"] += 1
            ended.append(lease)
            return Released(tuple(ended), "over_cap")
        self._add(lease)
        # The new lease is the most recently used, so it goes last; it can still go if it is
        # the lowest priority and everything else has gone.
        while self.pinned_blocks > self.cap_blocks:
            victim = self._victim(exclude={session_id})
            if victim is None:
                break
            ended.append(self._end(victim, "over_cap"))
        return Released(tuple(ended), "pin")

    def renew(self, session_id: str, *, ttl_s: float | None = None,
              priority: int | None = None) -> bool:
        """Extend a live lease (the session's next turn is coming); False if there is none."""
        lease = self._live(session_id)
        if lease is None:
            return False
        now = self._clock()
        self._index(Lease(session_id, lease.blocks,
                          lease.priority if priority is None else priority,
                          now + self.policy.ttl(ttl_s), now))
        return True

    def release(self, session_id: str, reason: str = "release") -> Released:
        """End a session's lease (`final`, DELETE): its blocks to free, if it had one."""
        lease = self._leases.get(session_id)
        if lease is None:
            return Released((), reason)
        return Released((self._end(lease, reason),), reason)

    def release_all(self, reason: str = "reset") -> Released:
        """End every lease (the prefix cache is being reset)."""
        return Released(tuple(self._end(lease, reason) for lease in list(self._leases.values())),
                        reason)

    def expire(self) -> Released:
        """End every lease past its deadline. Called from scheduler callbacks; costs one heap
        look when nothing is due, so it may run every step."""
        now = self._clock()
        gone = []
        while (lease := self._next_to_expire()) is not None and lease.expires_at <= now:
            gone.append(self._end(lease, "expired"))
        return Released(tuple(gone), "expired")

    def next_expiry(self) -> float:
        """The earliest deadline of any lease (infinity when there is none)."""
        lease = self._next_to_expire()
        return math.inf if lease is None else lease.expires_at

    def due(self) -> bool:
        """Whether some lease is past its deadline and waits for `expire`."""
        return self.next_expiry() <= self._clock()

    def evict(self, keep: Iterable[str] = ()) -> Released:
        """End the least valuable lease, for room: the lowest priority, then the least recently
        used; sessions in `keep` (the request being admitted) are spared. Nothing left to end:
        an empty `Released` (a request never waits on a pin; vLLM's admission decides)."""
        victim = self._victim(exclude=set(keep))
        return Released(() if victim is None else (self._end(victim, "pressure"),), "pressure")

    # -- internals ---------------------------------------------------------------------------

    def _live(self, session_id: str) -> Lease | None:
        lease = self._leases.get(session_id)
        if lease is not None and lease.expires_at <= self._clock():
            return None
        return lease

    def _victim(self, exclude: set[str]) -> Lease | None:
        heap, skipped = self._by_value, []
        victim = None
        while heap:
            *_, version, session_id = heap[0]
            if self._version.get(session_id) != version:
                heapq.heappop(heap)  # stale: replaced, renewed or ended since
            elif session_id in exclude:
                skipped.append(heapq.heappop(heap))
            else:
                victim = self._leases[session_id]
                break
        for entry in skipped:  # `exclude` is the one session being admitted: cheap
            heapq.heappush(heap, entry)
        return victim

    def _next_to_expire(self) -> Lease | None:
        heap = self._by_deadline
        while heap:
            _, version, session_id = heap[0]
            if self._version.get(session_id) == version:
                return self._leases[session_id]
            heapq.heappop(heap)
        return None

    def _add(self, lease: Lease) -> None:
        self._index(lease)
        self._refs.update(lease.blocks)

    def _index(self, lease: Lease) -> None:
        """Make `lease` its session's current one, in both heaps."""
        session_id, version = lease.session_id, next(self._versions)
        self._leases[session_id] = lease
        self._version[session_id] = version
        heapq.heappush(self._by_deadline, (lease.expires_at, version, session_id))
        heapq.heappush(self._by_value, (lease.priority, lease.last_used, version, session_id))
        # Stale entries leave a heap only when they reach its top: drop them all once they
        # outnumber the live ones, which keeps the cost amortized O(log n).
        if max(len(self._by_deadline), len(self._by_value)) > 2 * len(self._leases) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        live = [(lease, self._version[sid]) for sid, lease in self._leases.items()]
        self._by_deadline = [(lease.expires_at, v, lease.session_id) for lease, v in live]
        self._by_value = [(lease.priority, lease.last_used, v, lease.session_id)
                          for lease, v in live]
        heapq.heapify(self._by_deadline)
        heapq.heapify(self._by_value)

    def _drop(self, session_id: str) -> Lease | None:
        lease = self._leases.pop(session_id, None)
        self._version.pop(session_id, None)
        if lease is not None:
            refs = self._refs
            for block in lease.blocks:
                # Only this lease's blocks are visited: the table is walked on every release.
                if refs[block] <= 1:
                    del refs[block]
                else:
                    refs[block] -= 1
        return lease

    def _end(self, lease: Lease, reason: str) -> Lease:
        self._drop(lease.session_id)
        self.released_total[reason] += 1
        return lease
