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
- pinned blocks are capped per engine; over the cap, or when room is needed, the lease whose
  session is expected back last goes first, then the lowest priority (below); a lease never
  makes a request wait.

Which lease goes for room. A client that knows its next turn's time (`next_turn_in`, e.g. the
tool call it is about to run) makes its lease record when the session is expected back:
`last_used + next_turn_in_s`. Keeping the session back in two seconds over the one back in a
minute is what saves a recompute, so the latest expected return goes first; priority, then
least recent use, only break ties. A lease without a hint counts as expected back at its TTL
horizon (its deadline), the latest its client can still use it. Ordering un-hinted leases by
that horizon alone would be wrong, though: with equal TTLs the most recently used has the
latest deadline and would go first. So un-hinted leases keep today's order among themselves
(lowest priority, then least recently used), and only their candidate is set against the
hinted one: it goes first if its deadline is at or after the hinted lease's expected return
(equal: the lower priority, then the less recent, goes), else the hinted lease does. A client
without hints gets exactly least-recently-used within priority. A session late for its
announced return keeps its place: it is due any moment, and its TTL still bounds it.

One owner of the clock: the table reads `clock()` and nothing else does. Blocks shared by
several leases (a common system prompt) are counted once against the cap, and a lease frees
only its own reference to them.

Three heaps keep every decision logarithmic in the number of leases: one by deadline (what
expires next, and when: the scheduler side wakes an idle engine then), and for the next
victim one of hinted leases by expected return (latest first), then priority and last use,
and one of un-hinted leases by priority and last use; each lease is in exactly one of the last
two, and a victim is the better of their two tops. A renewal or a new turn pushes fresh entries
and leaves the old ones behind; an entry counts only while it is its session's latest (lazy
invalidation), and the heaps are rebuilt when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from turnkv_server.connector.settings import ConnectorSettings

# Victim heap entries end with (version, session), whatever comes before.
_Entry = TypeVar("_Entry", bound=tuple[Any, ...])


@dataclass(frozen=True)
class LeaseLimits:
    """The operator's settings: TTLs in seconds, and the pin cap as a share of the cache."""

    default_ttl_s: float = ConnectorSettings.lease_ttl_s
    max_ttl_s: float = ConnectorSettings.lease_max_ttl_s
    max_pinned_fraction: float = ConnectorSettings.max_pinned_fraction

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


def _back_at(now: float, next_turn_in_s: float | None) -> float | None:
    if next_turn_in_s is None:
        return None
    if not 0 <= next_turn_in_s < math.inf:
        raise ValueError(f"next_turn_in_s must be a non-negative number, not {next_turn_in_s}")
    return now + next_turn_in_s


@dataclass(frozen=True)
class Lease:
    """One session's hold: its blocks in prompt order, its priority, its deadline, when its
    client hinted it, when the session is expected back, and which life of the session
    (`epoch`, the router's) the request that pinned it belonged to."""

    session_id: str
    blocks: tuple[int, ...]
    priority: int
    expires_at: float
    last_used: float
    expected_back: float | None = None
    epoch: int | None = None

    @property
    def back_by(self) -> float:
        """When the session is expected back: as hinted, else at its TTL horizon."""
        return self.expires_at if self.expected_back is None else self.expected_back

    def eviction_key(self) -> tuple[float, int, float]:
        """Smallest goes first: latest return, then lowest priority, then least recent use."""
        return (-self.back_by, self.priority, self.last_used)


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

    def __init__(self, total_blocks: int, policy: LeaseLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total_blocks < 1:
            raise ValueError("total_blocks must be at least 1")
        self.policy = policy or LeaseLimits()
        self.cap_blocks = int(total_blocks * self.policy.max_pinned_fraction)
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        # Heap entries end with (version, session): valid while `_version[session]` matches.
        self._by_deadline: list[tuple[float, int, str]] = []
        self._by_value: list[tuple[int, float, int, str]] = []  # un-hinted leases
        self._by_return: list[tuple[float, int, float, int, str]] = []  # hinted ones
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
            priority: int = 0, next_turn_in_s: float | None = None,
            epoch: int | None = None) -> Released:
        """Hold `blocks` for the session (its turn just ended), replacing its previous lease;
        `next_turn_in_s`: the client's hint of when its next turn comes.

        The caller touches `blocks` first, then frees what this returns: the previous lease's
        references, and any leases pushed out by the cap. A lease larger than the cap on its
        own is not kept: its blocks come straight back.
        """
        now = self._clock()
        expires_at, back = now + self.policy.ttl(ttl_s), _back_at(now, next_turn_in_s)
        previous = self._drop(session_id)
        ended = [previous] if previous else []
        lease = Lease(session_id, tuple(blocks), priority, expires_at, now, back, epoch)
        if len(set(lease.blocks)) > self.cap_blocks:
            self.released_total["over_cap"] += 1
            ended.append(lease)
            return Released(tuple(ended), "over_cap")
        self._add(lease)
        # The new lease is spared: the cap is the other leases' to make room under (alone, it
        # fits, or it was refused above).
        while self.pinned_blocks > self.cap_blocks:
            victim = self._victim(exclude={session_id})
            if victim is None:
                break
            ended.append(self._end(victim, "over_cap"))
        return Released(tuple(ended), "pin")

    def renew(self, session_id: str, *, ttl_s: float | None = None,
              priority: int | None = None, next_turn_in_s: float | None = None) -> bool:
        """Extend a live lease (the session's next turn is coming); False if there is none.
        Its expected return becomes now + `next_turn_in_s`, or none without a hint."""
        lease = self._live(session_id)
        if lease is None:
            return False
        now = self._clock()
        expires_at, back = now + self.policy.ttl(ttl_s), _back_at(now, next_turn_in_s)
        self._index(Lease(session_id, lease.blocks,
                          lease.priority if priority is None else priority,
                          expires_at, now, back, lease.epoch))
        return True

    def release(self, session_id: str, reason: str = "release",
                epoch: int | None = None) -> Released:
        """End a session's lease (`final`, DELETE): its blocks to free, if it had one. A
        release of the session's life `epoch` leaves a later life's lease alone."""
        lease = self._leases.get(session_id)
        if lease is None or (epoch is not None and lease.epoch is not None
                             and lease.epoch > epoch):
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

    def now(self) -> float:
        return self._clock()

    def due(self) -> bool:
        """Whether some lease is past its deadline and waits for `expire`."""
        return self.next_expiry() <= self._clock()

    def evict(self, keep: Iterable[str] = (), reason: str = "pressure") -> Released:
        """End the least valuable lease, for room: the one whose session is expected back last,
        then the lowest priority (see the module docstring); sessions in `keep` (the request
        being admitted) are spared. Nothing left to end: an empty `Released` (a request never
        waits on a pin; vLLM's admission decides). `reason`: "stuck" for a step that
        scheduled nothing (`room`)."""
        victim = self._victim(exclude=set(keep))
        return Released(() if victim is None else (self._end(victim, reason),), reason)

    # -- internals ---------------------------------------------------------------------------

    def _live(self, session_id: str) -> Lease | None:
        lease = self._leases.get(session_id)
        if lease is not None and lease.expires_at <= self._clock():
            return None
        return lease

    def _victim(self, exclude: set[str]) -> Lease | None:
        hinted = self._top(self._by_return, exclude)
        plain = self._top(self._by_value, exclude)
        if hinted is None or plain is None:
            return hinted or plain
        # The un-hinted candidate counts as back at its deadline; a tie goes to it.
        return plain if plain.eviction_key() <= hinted.eviction_key() else hinted

    def _top(self, heap: list[_Entry], exclude: set[str]) -> Lease | None:
        """The live lease at the top of `heap`, not in `exclude`; `heap` keeps it."""
        skipped, top = [], None
        while heap:
            version, session_id = heap[0][-2:]
            if self._version.get(session_id) != version:
                heapq.heappop(heap)  # stale: replaced, renewed or ended since
            elif session_id in exclude:
                skipped.append(heapq.heappop(heap))
            else:
                top = self._leases[session_id]
                break
        for entry in skipped:  # `exclude` is the one session being admitted: cheap
            heapq.heappush(heap, entry)
        return top

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
        """Make `lease` its session's current one, in the deadline heap and a victim heap."""
        session_id, version = lease.session_id, next(self._versions)
        self._leases[session_id] = lease
        self._version[session_id] = version
        heapq.heappush(self._by_deadline, (lease.expires_at, version, session_id))
        if lease.expected_back is None:
            heapq.heappush(self._by_value, (lease.priority, lease.last_used, version, session_id))
        else:
            heapq.heappush(self._by_return, (-lease.expected_back, lease.priority,
                                             lease.last_used, version, session_id))
        # Stale entries leave a heap only when they reach its top: drop them all once they
        # outnumber the live ones, which keeps the cost amortized O(log n).
        if max(len(self._by_deadline), len(self._by_value),
               len(self._by_return)) > 2 * len(self._leases) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        live = [(lease, self._version[sid]) for sid, lease in self._leases.items()]
        self._by_deadline = [(lease.expires_at, v, lease.session_id) for lease, v in live]
        self._by_value = [(lease.priority, lease.last_used, v, lease.session_id)
                          for lease, v in live if lease.expected_back is None]
        self._by_return = [(-lease.expected_back, lease.priority, lease.last_used, v,
                            lease.session_id)
                           for lease, v in live if lease.expected_back is not None]
        heapq.heapify(self._by_deadline)
        heapq.heapify(self._by_value)
        heapq.heapify(self._by_return)

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
