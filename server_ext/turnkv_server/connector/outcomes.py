"""What the transfer thread reports to the engine's step thread, and the lock between them."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from turnkv_server.connector.stats import TransferCounters


@dataclass
class TransferResults:
    """What finished since the last `take`."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)
    # Receives given up while their sender might still write into their blocks: each request
    # recomputes on other blocks (vLLM's failed receive, which frees the request's blocks),
    # and these blocks stay held until `settled` names the request.
    quarantined: set[str] = field(default_factory=set)
    settled: set[str] = field(default_factory=set)
    counters: TransferCounters = field(default_factory=TransferCounters)


class Outcomes:
    """Results written by the transfer thread, taken by the step thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results = TransferResults()

    def take(self) -> TransferResults:
        with self._lock:
            results, self._results = self._results, TransferResults()
        return results

    def received(self, request_id: str, failed_blocks: Iterable[int] = (), **counts: float
                 ) -> None:
        """A receive ended: its request may go on (recomputing `failed_blocks`)."""
        with self._lock:
            self._results.finished_recving.add(request_id)
            self._results.failed_blocks.update(failed_blocks)
            self._count(counts)

    def quarantined(self, request_id: str, **counts: float) -> None:
        """A receive ended without its KV while its sender may still write: its request goes
        on with other blocks; its own blocks stay out of use until `settled`.

        The request is reported finished *and* in `quarantined`, which the connector hands
        vLLM as a failed receive (`KVConnectorTransferResults.failed_recving`): vLLM keeps a
        failed receive only for a request that is also finished receiving (its
        `KVOutputAggregator` intersects the two), and then frees the request's blocks and
        computes its prompt anew instead of using them."""
        with self._lock:
            self._results.finished_recving.add(request_id)
            self._results.quarantined.add(request_id)
            self._count(counts)

    def settled(self, request_id: str, **counts: float) -> None:
        """No write of a quarantined receive's sender can land any more: its blocks may go."""
        with self._lock:
            self._results.settled.add(request_id)
            self._count(counts)

    def sent(self, request_id: str, **counts: float) -> None:
        """A send ended (written, failed or given up): its request's blocks may go."""
        with self._lock:
            self._results.finished_sending.add(request_id)
            self._count(counts)

    def count(self, **counts: float) -> None:
        with self._lock:
            self._count(counts)

    def _count(self, counts: dict[str, float]) -> None:
        c = self._results.counters
        for name, value in counts.items():
            setattr(c, name, getattr(c, name) + value)
