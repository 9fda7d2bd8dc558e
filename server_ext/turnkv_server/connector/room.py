"""Room for requests: when leases, and sends nobody has registered for, give their blocks back.

vLLM's scheduler counts held blocks as used and cannot give them back itself, so a lease must
never make a request wait. The scheduler side calls here at four moments:

- before a waiting request is matched (`for_admission`): leases end, least valuable first,
  until the blocks vLLM's admission will take are free (`BlockHolder.admission_need`); the
  request's own session's lease last, only if the others were not enough;
- after each step (`for_running`): leases end until there is a free block per running
  request. vLLM's running loop stops for the whole step at the first request that cannot grow
  once the connector says blocks are coming back (`has_pending_block_frees`, upstream
  `v1/core/sched/scheduler.py`), so every running request after it would skip the step;
  with this reserve a decoding request, which grows by a block at most per step, never meets
  an empty pool;
- when a running request cannot grow all the same (`for_growth`, a prefill chunk that needs
  more than a block, say): until one block comes back;
- after a step that scheduled nothing while a request that could run lacks blocks
  (`for_stuck_step`): vLLM asks the connector nothing for a request whose KV has arrived and
  that now waits in its queue for the blocks its last tokens need. Such a step ends one lease;
  the next step tries again. A step can schedule nothing for other reasons: a lookup a tier
  beside this connector deferred ("ask again later": vLLM skips the request, which lacks no
  block), or a paused scheduler. Those end no lease: a request lacks blocks only if the free
  ones are fewer than what its admission takes (`_lacks_blocks`; vLLM's watermark, off by
  default, is not counted).

When no lease is left, sends that no receiver has registered for yet give their blocks up
(`abandon`). Runs in vLLM's engine-core thread, like the rest of the scheduler side.
"""

from __future__ import annotations

from collections.abc import Callable

from turnkv_server.connector.holds import BlockHolder
from turnkv_server.connector.pending_sends import PendingSends
from turnkv_server.connector.request_view import Request

# vLLM's statuses of a request that could run if it had the blocks (upstream
# `v1/request.py`); one waiting for its KV to arrive could not.
READY = frozenset({"WAITING", "PREEMPTED"})


class Room:
    """Makes room on one engine's block pool; each method returns whether a lease ended."""

    def __init__(self, holder: BlockHolder, sends: PendingSends, block_size: int,
                 abandon: Callable[[str], None]) -> None:
        self.holder = holder
        self.block_size = block_size
        self._sends = sends
        self._abandon = abandon
        # Every request the engine holds, turnkv's or not: the running ones get a free block
        # each, and a step that schedules nothing is stuck only if one of them lacks blocks.
        self._requests: dict[str, Request] = {}

    def arrived(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def left(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def for_admission(self, request: Request, hit_tokens: int, keep: list[str]) -> bool:
        """`request` waits with a local prefix hit of `hit_tokens`; `keep`: its session."""
        holder, pool = self.holder, self.holder.pool
        leases = len(holder.leases)

        def needed() -> int:  # and a spare block for the first generated token
            return holder.admission_need(self.block_size, request.num_tokens,
                                         request.block_hashes, hit_tokens) + 1

        holder.make_room(needed, keep=keep)
        if keep and pool.get_num_free_blocks() < needed() - 1:
            # Still short (the spare aside): its own session's lease goes too, or it would hold
            # blocks the request did not find as its prefix while the request waited for them.
            holder.make_room(lambda: needed() - 1)
        self._abandon_sends(needed() - pool.get_num_free_blocks())
        return len(holder.leases) != leases

    def for_running(self) -> bool:
        """The step is built: keep a free block per running request for the next one."""
        running = sum(r.status.name == "RUNNING" for r in self._requests.values())
        if self.holder.pool.get_num_free_blocks() >= running:
            return False
        leases = len(self.holder.leases)
        self.holder.make_room(running)
        return len(self.holder.leases) != leases

    def for_growth(self) -> tuple[bool, bool]:
        """A running request cannot grow: (whether a block came back, whether a lease
        ended). A lease whose blocks a running request also uses frees nothing."""
        leases = len(self.holder.leases)
        freed = self.holder.make_room(self.holder.pool.get_num_free_blocks() + 1)
        return freed > 0, len(self.holder.leases) != leases

    def for_stuck_step(self, scheduled_tokens: int) -> bool:
        """The step just built schedules `scheduled_tokens` tokens: none while a request that
        could run lacks blocks means it waits for room (nothing runs that could free any)."""
        if scheduled_tokens or not any(r.status.name in READY and self._lacks_blocks(r)
                                       for r in self._requests.values()):
            return False
        if self.holder.evict_one("stuck"):
            return True
        self._abandon_sends(1)
        return False

    def _lacks_blocks(self, request: Request) -> bool:
        """Whether the free blocks are fewer than `request`'s admission takes. One whose KV
        has arrived holds the blocks of its computed tokens and needs the rest; one with none
        computed takes every block of its sequence but the prefix hits something else holds
        (as far as its hashes reach: vLLM caps a hit a token short of the prompt)."""
        size, computed = self.block_size, request.num_computed_tokens
        if computed:
            need = -(-request.num_tokens // size) - -(-computed // size)
        else:
            need = self.holder.admission_need(size, request.num_tokens, request.block_hashes,
                                              request.num_tokens - 1)
        return need > self.holder.pool.get_num_free_blocks()

    def _abandon_sends(self, blocks_short: int) -> None:
        for transfer_id in self._sends.for_room(blocks_short):
            self._abandon(transfer_id)
