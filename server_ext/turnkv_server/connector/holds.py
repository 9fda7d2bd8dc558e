"""Session leases applied to vLLM's block pool: a reference per held block, given back on time.

The connector's scheduler side calls this from the engine-core thread only (scheduler
callbacks and the engine's own calls into the pool), which owns the block pool and takes no
lock. `hold` runs in `request_finished`: it adds one reference to each of the finished
request's blocks, so they outlive the request without delay-free, keep their hashes and serve
the session's next turn as prefix hits, and the engine can go idle. The lease table (`leases`)
decides when the references go: on release, expiry, the pin cap, a prefix-cache reset, and
`make_room` under pressure, which the admission callbacks call because vLLM's scheduler counts
held blocks as used and cannot give them back itself. A prefix-cache reset fails while any
block is in use, so `release_leases_before_reset` makes the pool's own reset release every
lease first.

Two bounds keep what the holder keeps from going stale or eating the cache. A session's
released lives (`session_epochs`) hold and renew nothing: `current` says whether a request's
life still may. Quarantined blocks cannot be handed back early (a late write would land in
whatever KV used them next), so their share is bounded the safe way: while they are over
`max_quarantined` blocks, no new receive starts (`quarantine_full`; the scheduler side
declines it and the request computes its prompt itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from turnkv_server.connector.leases import LeaseTable, Released
from turnkv_server.connector.session_epochs import ReleasedSessions


class Block(Protocol):
    """The part of vLLM's `KVCacheBlock` read here."""

    block_id: int
    is_null: bool


class BlockPool(Protocol):
    """The part of vLLM's `BlockPool` used here (`v1/core/block_pool.py`)."""

    @property
    def blocks(self) -> Sequence[Any]: ...

    def touch(self, blocks: Sequence[Any]) -> None: ...
    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...
    def get_num_free_blocks(self) -> int: ...
    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: list[int]
                         ) -> list[Any] | None: ...


# How often an idle engine with quarantined blocks steps, to hear whether they may go.
QUARANTINE_POLL_S = 1.0


class BlockHolder:
    """One engine's held blocks: `leases` decides, this applies it to `pool`."""

    def __init__(self, pool: BlockPool, leases: LeaseTable,
                 max_quarantined: float = math.inf) -> None:
        self.pool = pool
        self.leases = leases
        self.freed_total = 0
        # The session lives released here: the operator's longest lease outlives any request.
        self.released = ReleasedSessions(leases.now, leases.policy.max_ttl_s)
        self.max_quarantined = max_quarantined
        # Blocks of given-up receives that a late write may still land in, by request: no
        # request may use them until the transport says none can (`receiving`). The worker says
        # so in a step's output: while any is held, an idle engine steps every
        # QUARANTINE_POLL_S to hear it (`due`, `next_wake`).
        self.quarantined: dict[str, list[int]] = {}
        self._poll_at = math.inf

    def quarantine(self, request_id: str, block_ids: Iterable[int]) -> None:
        """Keep `block_ids` out of use; taken while the request still references them, so
        that vLLM freeing the request leaves them allocated, to us."""
        ids = [i for i in block_ids if not self.pool.blocks[i].is_null]
        self.pool.touch([self.pool.blocks[i] for i in ids])
        self.quarantined.setdefault(request_id, []).extend(ids)
        self.stepped()

    def settle(self, request_id: str) -> int:
        """Give a quarantine's blocks back; returns how many."""
        ids = self.quarantined.pop(request_id, [])
        if ids:
            self.pool.free_blocks([self.pool.blocks[i] for i in ids])
        return len(ids)

    @property
    def quarantined_blocks(self) -> int:
        return sum(map(len, self.quarantined.values()))

    @property
    def quarantine_full(self) -> bool:
        """Whether quarantined blocks are over their cap: no receive may start."""
        return self.quarantined_blocks > self.max_quarantined

    def stepped(self) -> None:
        """The engine stepped (and heard the worker): the next check is a poll away."""
        self._poll_at = (self.leases.now() + QUARANTINE_POLL_S if self.quarantined
                         else math.inf)

    def due(self) -> bool:
        """Whether an idle engine must step: a lease is past its deadline, or a quarantine
        is due a check."""
        return self.leases.due() or self._poll_at <= self.leases.now()

    def next_wake(self) -> float:
        return min(self.leases.next_expiry(), self._poll_at)

    def current(self, session_id: str, epoch: int | None) -> bool:
        """Whether a request of the session's life `epoch` may hold or renew its lease: its life
        has not been released, and the lease is not a later life's. No epoch: yes."""
        if epoch is None:
            return True
        lease = self.leases.get(session_id)
        return not (self.released.ended(session_id, epoch)
                    or (lease is not None and lease.epoch is not None and lease.epoch > epoch))

    def hold(self, session_id: str, block_ids: Sequence[int], *, ttl_s: float | None = None,
             priority: int = 0, next_turn_in_s: float | None = None,
             epoch: int | None = None) -> int:
        """Keep a finished turn's blocks for its session (expected back in `next_turn_in_s`,
        when its client said); returns how many it now holds.

        The new references are taken before the previous lease's are dropped, so blocks the
        two turns share never reach a reference count of 0 on the way.
        """
        ids = [i for i in block_ids if not self.pool.blocks[i].is_null]
        self.pool.touch([self.pool.blocks[i] for i in ids])
        self._free(self.leases.pin(session_id, ids, ttl_s=ttl_s, priority=priority,
                                   next_turn_in_s=next_turn_in_s, epoch=epoch))
        lease = self.leases.get(session_id)
        return len(lease.blocks) if lease else 0

    def release(self, session_id: str, reason: str = "release", epoch: int | None = None) -> int:
        """End a session's hold (`final`, DELETE) and, with its `epoch`, every request of that
        life or an earlier one (`current`); returns the references freed."""
        if epoch is not None:
            self.released.record(session_id, epoch)
        return self._free(self.leases.release(session_id, reason, epoch))

    def release_all(self, reason: str = "reset") -> int:
        """End every hold (the prefix cache is being reset); returns the references freed."""
        return self._free(self.leases.release_all(reason))

    def expire(self) -> int:
        """Free the holds past their deadline; returns the references freed."""
        return self._free(self.leases.expire())

    def make_room(self, blocks_needed: int | Callable[[], int], keep: Iterable[str] = (),
                  reason: str = "pressure") -> int:
        """Free holds until `blocks_needed` blocks are free, or no hold is left to free (a
        request never waits on a lease). Returns the blocks that came back to the pool.

        Each victim is freed before the next is chosen and the pool's own free count decides:
        a held block that a running request (or another lease) also references goes back to
        the pool only with its last reference, so it is not counted as room. A callable
        `blocks_needed` is asked again after each victim: freeing a block the request will
        hit as its prefix adds to both sides (`admission_need`).
        """
        pool = self.pool
        need = blocks_needed if callable(blocks_needed) else lambda: blocks_needed
        start = pool.get_num_free_blocks()
        while pool.get_num_free_blocks() < need():
            released = self.leases.evict(keep, reason)
            if not released.leases:
                break
            self._free(released)
        return pool.get_num_free_blocks() - start

    def evict_one(self, reason: str = "pressure") -> bool:
        """End the least valuable lease for room; False if no lease is left."""
        released = self.leases.evict(reason=reason)
        self._free(released)
        return bool(released.leases)

    def admission_need(self, block_size: int, num_tokens: int, block_hashes: Sequence[Any],
                       hit_tokens: int) -> int:
        """The free blocks vLLM's admission takes for a waiting request of `num_tokens` tokens
        whose first `hit_tokens` are a local prefix hit: every block of the sequence (it admits a
        prompt only if all of it fits) less the hit blocks something else references. A hit block
        nobody references sits among the free blocks, and adopting it takes it from them, so it
        counts: leaving it out made a request wait behind a lease for ever while it looked as if
        it fitted. Without hashes at `block_size` granularity every hit block counts.
        """
        if getattr(self.pool, "hash_block_size", block_size) != block_size:
            block_hashes = ()
        referenced = 0
        for block_hash in block_hashes[:hit_tokens // block_size]:
            cached = self.pool.get_cached_block(block_hash, [0])
            if cached is None:
                break
            referenced += cached[0].ref_cnt > 0
        return -(-num_tokens // block_size) - referenced

    def _free(self, released: Released) -> int:
        blocks = released.blocks
        if blocks:
            self.pool.free_blocks([self.pool.blocks[i] for i in blocks])
            self.freed_total += len(blocks)
        return len(blocks)


def release_leases_before_reset(pool: BlockPool, release: Callable[[], object]) -> None:
    """Make `pool`'s `reset_prefix_cache` call `release` (which releases every lease) first:
    a prefix-cache reset fails while any block is in use, held ones included."""
    reset = getattr(pool, "reset_prefix_cache", None)
    if reset is None:
        return
    original = getattr(reset, "turnkv_original", reset)  # bound again: wrap once

    def reset_prefix_cache() -> bool:
        release()
        return bool(original())

    reset_prefix_cache.turnkv_original = original  # type: ignore[attr-defined]
    setattr(pool, "reset_prefix_cache", reset_prefix_cache)  # noqa: B010
