"""The sends the scheduler half owes, and which of them to give up.

A request that ends normally with a send keeps its blocks (vLLM delay-frees them) until the
worker reports the send over: written, failed or abandoned. When a request needs room that
leases cannot make, the oldest sends nobody has registered for are abandoned (their receivers
recompute): otherwise two engines whose caches are full of blocks kept for each other wait on
each other until the transfers time out. The router can abandon a send too, possibly before
its request has ended or even arrived here (its abandon overtook it in the API server): that
is remembered for `ABANDON_MEMORY_S`, and the request refuses its send when it ends.

Runs in vLLM's engine-core thread, with the scheduler half; the worker is told through
`StepOrders.abandons`.
"""

from __future__ import annotations

import time

# How long an abandon is remembered for a send whose request has not ended (or arrived) yet.
ABANDON_MEMORY_S = 600.0


class PendingSends:
    def __init__(self) -> None:
        # Delay-freed requests waiting for their send, oldest first: request ID ->
        # (transfer ID, blocks, abandoned).
        self._waiting: dict[str, tuple[str, int, bool]] = {}
        # Sends the router gave up before their request ended, or before it even arrived
        # here, with when: they refuse.
        self._abandoned_early: dict[str, float] = {}

    def add(self, request_id: str, transfer_id: str, blocks: int) -> None:
        """The request finished and keeps `blocks` blocks until its send is over."""
        self._waiting[request_id] = (transfer_id, blocks, False)

    def done(self, request_id: str) -> None:
        """The worker reports the request's send over: its blocks are free."""
        self._waiting.pop(request_id, None)

    def abandoned_early(self, transfer_id: str) -> bool:
        """Whether the send was given up before its request ended (asked once, as it ends)."""
        return self._abandoned_early.pop(transfer_id, None) is not None

    def abandon(self, transfer_id: str) -> bool:
        """Give the send up; returns whether the worker must be told (it was not already)."""
        for request_id, (tid, blocks, abandoned) in self._waiting.items():
            if tid == transfer_id:
                # Finished and waiting for a receiver: the transport lets it go.
                if not abandoned:
                    self._waiting[request_id] = (tid, blocks, True)
                return not abandoned
        # Its request is still running, or has not arrived yet: it refuses when it ends
        # (and the transport, told now, answers a registration that comes meanwhile).
        now = time.monotonic()
        self._abandoned_early[transfer_id] = now
        while self._abandoned_early:  # oldest first; a send's request comes within seconds
            oldest, at = next(iter(self._abandoned_early.items()))
            if now - at <= ABANDON_MEMORY_S:
                break
            del self._abandoned_early[oldest]
        return True

    def for_room(self, short: int) -> list[str]:
        """The sends to abandon, oldest first, for `short` more free blocks. Blocks already
        abandoned count: they are on their way back (the worker frees them next step)."""
        chosen = []
        for transfer_id, blocks, abandoned in self._waiting.values():
            if short <= 0:
                break
            short -= blocks
            if not abandoned:
                chosen.append(transfer_id)
        return chosen
