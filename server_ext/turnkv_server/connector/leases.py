"""Session leases on one engine: which KV blocks each session keeps after its turn, until when.

The connector's scheduler side holds a finished turn's blocks by reference (it `touch()`es
them in the block pool) instead of delay-freeing the request, so an engine holding leases goes
idle (CONNECTOR-NOTES.md, "Holding KV after a request ends"). Held blocks are invisible to
vLLM's admission, so the holder must give them back itself: on expiry, on release, when the
pinned blocks pass their cap, and when a new request needs room. This table decides which; it
never touches the block pool. Every method returns the block IDs whose hold ends, and the
caller frees exactly those (one reference each), from a scheduler callback.

The rules follow SGLang's TTL policy and BRIEF.md's protocol:
- the operator sets a default TTL and a cap; a client's TTL may only shorten the cap;
- a session's next turn replaces its lease (and renews it); `final`, DELETE or expiry end it;
- pinned blocks are capped per engine; over the cap, or when room is needed, the lowest
  priority, least recently used leases go first; a lease never makes a request wait.

One owner of the clock: the table reads `clock()` and nothing else does. Blocks shared by
several leases (a common system prompt) are counted once against the cap, and a lease frees
only its own reference to them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
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
        self._next_expiry = float("-inf")
        self._leases: dict[str, Lease] = {}
        # How many leases hold each block: the cap counts distinct blocks.
        self._refs: Counter[int] = Counter()
        self.released_total: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._leases

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
        self._leases[session_id] = Lease(
            session_id, lease.blocks, lease.priority if priority is None else priority,
            now + self.policy.ttl(ttl_s), now)
        return True

    def release(self, session_id: str, reason: str = "release") -> Released:
        """End a session's lease (`final`, DELETE): its blocks to free, if it had one."""
        lease = self._leases.get(session_id)
        if lease is None:
            return Released((), reason)
        return Released((self._end(lease, reason),), reason)

    def expire(self, at_most_every_s: float = 0.0) -> Released:
        """End every lease past its deadline; called lazily from scheduler callbacks, which
        may ask to look at most every `at_most_every_s` (a held block past its TTL is
        harmless until then)."""
        now = self._clock()
        if now < self._next_expiry:
            return Released((), "expired")
        self._next_expiry = now + at_most_every_s
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        return Released(tuple(self._end(lease, "expired") for lease in gone), "expired")

    def make_room(self, blocks_needed: int, free_blocks: int,
                  keep: Iterable[str] = ()) -> Released:
        """Release leases until `free_blocks` plus what they free covers `blocks_needed`.

        Lowest priority first, then least recently used; sessions in `keep` (the request being
        admitted) are spared. Stops when no lease is left to release, so a request never waits
        on a pin: if it still does not fit, vLLM's own admission decides.
        """
        kept = set(keep)
        ended: list[Lease] = []
        while free_blocks < blocks_needed:
            victim = self._victim(exclude=kept)
            if victim is None:
                break
            free_blocks += self._exclusive_blocks(victim)
            ended.append(self._end(victim, "pressure"))
        return Released(tuple(ended), "pressure")

    # -- internals ---------------------------------------------------------------------------

    def _live(self, session_id: str) -> Lease | None:
        lease = self._leases.get(session_id)
        if lease is not None and lease.expires_at <= self._clock():
            return None
        return lease

    def _victim(self, exclude: set[str]) -> Lease | None:
        candidates = [lease for sid, lease in self._leases.items() if sid not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda lease: (lease.priority, lease.last_used))

    def _exclusive_blocks(self, lease: Lease) -> int:
        # Blocks only this lease holds: what releasing it gives back to the free pool.
        return sum(1 for b in lease.blocks if self._refs[b] == 1)

    def _add(self, lease: Lease) -> None:
        self._leases[lease.session_id] = lease
        self._refs.update(lease.blocks)

    def _drop(self, session_id: str) -> Lease | None:
        lease = self._leases.pop(session_id, None)
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
