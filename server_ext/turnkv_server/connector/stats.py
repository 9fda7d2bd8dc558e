"""The connector's counters, on vLLM's own path to `/metrics`.

Both halves of the connector report: the worker (blocks and bytes moved, transfer times,
failures) and the scheduler (lease hits, misses, releases by reason, pinned blocks). vLLM asks
each half for `get_kv_connector_stats()` every step, sums them with `aggregate`, and hands the
sum to the Prometheus object that `build_prom_metrics` returned, which exposes every counter as
``turnkv:<name>_total`` and the gauges as ``turnkv:<name>`` on the engine's `/metrics`.
The transfer thread counts in `TransferCounters`, the scheduler half in `SchedulerCounters`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class TransferCounters:
    """What the worker's transfer thread counted: the worker half of `COUNTERS`."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    bytes_streamed: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    sends_done: int = 0
    receives_done: int = 0
    sends_failed: int = 0
    receives_failed: int = 0
    sends_abandoned: int = 0
    receives_cancelled: int = 0
    receives_quarantined: int = 0
    quarantines_expired: int = 0
    transfers_mismatched: int = 0
    side_channel_rejected: int = 0
    notifications_rejected: int = 0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0

    def add(self, other: TransferCounters) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


# Counters are deltas since the last report; gauges are the latest value. The worker's names
# come from `TransferCounters`, so a field added there reaches `/metrics` too.
COUNTERS = (
    *(f.name for f in fields(TransferCounters)),
    "tokens_requested", "transfers_declined", "receives_declined_quarantine",
    "lease_hits", "lease_misses", "blocks_held", "leases_renewed", "renewals_missed",
    "leases_released", "leases_expired", "leases_over_cap", "leases_pressure", "leases_stuck",
    "holds_stale",
)
GAUGES = ("pinned_blocks", "leases", "quarantined_blocks")
# Why a lease ended (the lease table's `released_total` keys) -> the counter it adds to.
RELEASE_COUNTERS = {"release": "leases_released", "reset": "leases_released",
                    "expired": "leases_expired", "over_cap": "leases_over_cap",
                    "pressure": "leases_pressure", "stuck": "leases_stuck"}

HELP = {
    "blocks_sent": "KV blocks this engine wrote to another engine",
    "bytes_sent": "KV bytes this engine wrote to another engine",
    "bytes_streamed": "KV bytes written layer by layer while the sending request still computed",
    "blocks_received": "KV blocks another engine wrote into this one",
    "bytes_received": "KV bytes another engine wrote into this one",
    "sends_done": "Transfers this engine completed as the sender",
    "receives_done": "Transfers this engine completed as the receiver",
    "sends_failed": "Transfers that failed or were never asked for, sender side",
    "receives_failed": "Transfers that failed on the receiver; their blocks were recomputed",
    "sends_abandoned": "Sends given up before any receiver registered (room needed, or the "
                       "router said no receiver would come)",
    "receives_cancelled": "Receives this engine gave up on (timeout, abort) and cancelled with "
                          "the sender before reusing their blocks",
    "receives_quarantined": "Receives given up while the sender might still write: the "
                            "request recomputed on other blocks, its own held until safe",
    "quarantines_expired": "Quarantined blocks given back with no word from the sender, after "
                           "the longest a TCP connection retransmits",
    "transfers_mismatched": "Registrations refused because the two engines' tokens differ",
    "side_channel_rejected": "Side-channel messages dropped: bad signature, stale, replayed or "
                             "malformed",
    "notifications_rejected": "Completion notifications ignored: from an agent other than the "
                              "one the receive registered with",
    "send_seconds": "Seconds from write start to completion, summed",
    "receive_seconds": "Seconds from registration to arrival, summed",
    "tokens_requested": "Prompt tokens this engine asked a peer for",
    "transfers_declined": "Transfers not needed because every block was already here",
    "receives_declined_quarantine": "Receives declined (the prompt computed here instead) "
                                    "while quarantined blocks were over their share of the "
                                    "cache",
    "lease_hits": "Requests whose session still held a lease here",
    "lease_misses": "Requests of a session with no lease here (new, expired or released)",
    "blocks_held": "Blocks held under a lease when a turn ended",
    "leases_renewed": "Leases renewed by a hint sent between turns (a renew-only request)",
    "renewals_missed": "Renew-only requests for a session with no lease here",
    "leases_released": "Leases ended by final or DELETE",
    "leases_expired": "Leases ended by their TTL",
    "leases_over_cap": "Leases ended because pinned blocks passed the cap",
    "leases_pressure": "Leases ended to make room for a request",
    "leases_stuck": "Leases ended after a step scheduled nothing while a request that could "
                    "run lacked blocks",
    "holds_stale": "Holds and renewals ignored: their request belonged to a life of its "
                   "session that had been released (or to one before its lease's)",
    "pinned_blocks": "Distinct KV blocks held under leases",
    "leases": "Live session leases",
    "quarantined_blocks": "Blocks of given-up receives held until no late write can land",
}


class SchedulerCounters:
    """What the scheduler half counted since vLLM last asked, and its lease gauges."""

    def __init__(self) -> None:
        self._data: dict[str, Any] = {}
        # The lease table counts releases since it began: what was reported of each reason.
        self._released_seen: dict[str, int] = {}

    def count(self, key: str, amount: float = 1) -> None:
        self._data[key] = self._data.get(key, 0) + amount

    def gauges(self, *, pinned_blocks: int, leases: int, quarantined_blocks: int = 0) -> None:
        self._data["pinned_blocks"] = pinned_blocks
        self._data["leases"] = leases
        self._data["quarantined_blocks"] = quarantined_blocks

    def take(self, released_total: Mapping[str, int]) -> dict[str, Any]:
        """The counts since the last call, the releases among them (from the lease table's
        running totals)."""
        for reason, total in released_total.items():
            key = RELEASE_COUNTERS.get(reason)
            if key is None:
                continue
            delta = total - self._released_seen.get(reason, 0)
            if delta:
                self.count(key, delta)
                self._released_seen[reason] = total
        data, self._data = self._data, {}
        return data


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Sum counters, keep the latest gauges."""
    for key, value in other.items():
        if key in GAUGES:
            into[key] = value
        else:
            into[key] = into.get(key, 0) + value
    return into


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.get(key) for key in COUNTERS) and not any(k in data for k in GAUGES)


@dataclass
class MetricSet:
    """Prometheus counters and gauges, one child per engine label set."""

    counters: dict[str, dict[int, Any]]
    gauges: dict[str, dict[int, Any]]

    def observe(self, data: dict[str, Any], engine_idx: int) -> None:
        for key, value in data.items():
            if key in self.counters and value:
                self.counters[key][engine_idx].inc(value)
            elif key in self.gauges:
                self.gauges[key][engine_idx].set(value)


def build_metric_set(counter_cls: Any, gauge_cls: Any, labelnames: list[str],
                     per_engine_labelvalues: dict[int, list[object]]) -> MetricSet:
    def per_engine(metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

    counters = {name: per_engine(counter_cls(name=f"turnkv:{name}", documentation=HELP[name],
                                             labelnames=labelnames))
                for name in COUNTERS}
    gauges = {name: per_engine(gauge_cls(name=f"turnkv:{name}", documentation=HELP[name],
                                         labelnames=labelnames, multiprocess_mode="mostrecent"))
              for name in GAUGES}
    return MetricSet(counters, gauges)
