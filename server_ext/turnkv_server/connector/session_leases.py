"""What one request does to its session's lease on this engine, from its arrival to its end.

The session is the router's tenant-scoped key (`TurnParams.session`), never vLLM's own
`session_id`. When the request arrives (`arrived`):

- ``release`` (`final`, DELETE): the lease ends, and with the request's epoch so does every
  request of that life of the session (`holds.BlockHolder.current`);
- ``renew_only`` (a hint sent between turns): the lease takes the request's TTL, priority and
  expected return, counted from now; the request's own blocks are not held;
- otherwise the session is back: its lease is renewed (a hit) so that it survives until the
  request ends, or it has none (a miss).

When the request ends (`ended`) its blocks become the session's lease, unless it released or
only renewed, or it belongs to a life of the session that has ended since (or to an earlier
life than the lease's): such a request holds nothing (`holds_stale`), nor does it renew on
arrival. Holding an aborted request's blocks is safe: vLLM hashes only full blocks of computed
tokens, so the next turn can hit only KV of its own tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from turnkv_server.connector.holds import BlockHolder
from turnkv_server.engine.protocol import TurnParams


class SessionLeases:
    def __init__(self, holder: BlockHolder, count: Callable[[str, float], None]) -> None:
        self.holder = holder
        self._count = count

    def arrived(self, params: TurnParams) -> None:
        session, holder = params.session, self.holder
        if session is None:
            return
        if params.release:
            holder.release(session, epoch=params.epoch)
        elif not holder.current(session, params.epoch):
            if params.renew_only:  # (any other request is counted when it ends)
                self._count("holds_stale", 1)
        elif params.renew_only:
            renewed = holder.leases.renew(session, ttl_s=params.ttl_s, priority=params.priority,
                                          next_turn_in_s=params.next_turn_in_s)
            self._count("leases_renewed" if renewed else "renewals_missed", 1)
        # A hinted session is back now: this request needs its lease, and the hinted time
        # counts from the request's end (`ended` sets it then). Un-hinted: LRU as ever.
        elif holder.leases.renew(session, ttl_s=params.ttl_s, priority=params.priority,
                                 next_turn_in_s=None if params.next_turn_in_s is None else 0.0):
            self._count("lease_hits", 1)
        else:
            self._count("lease_misses", 1)

    def ended(self, params: TurnParams, block_ids: Sequence[int]) -> int:
        """The request ended with `block_ids`: the blocks its session now holds here."""
        session = params.session
        if session is None or params.release or params.renew_only or not block_ids:
            return 0
        if not self.holder.current(session, params.epoch):
            self._count("holds_stale", 1)
            return 0
        held = self.holder.hold(session, block_ids, ttl_s=params.ttl_s,
                                priority=params.priority, next_turn_in_s=params.next_turn_in_s,
                                epoch=params.epoch)
        self._count("blocks_held", held)
        return held
