"""What the simulation records: one outcome per turn, and the fleet's traffic counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class SimTurnOutcome(NamedTuple):
    session: str
    turn: int
    home: str  # the engine that decoded the turn
    prefill: str  # the engine that computed its prompt
    where: str  # the placement: whole, split, move (turnkv), or the mode's only one
    prompt: int
    computed: int
    cached: int  # found in the computing engine's KV cache
    from_tier: int  # read back from its host tier
    received: int  # KV moved to the decoding engine for this turn
    waited_ms: float  # the routing's own work, room in the cache, the prefill lane
    ttft_ms: float
    decode_ms: float  # after the first token
    output: int
    arrived_s: float

    @property
    def itl_ms(self) -> float | None:
        return self.decode_ms / (self.output - 1) if self.output > 1 else None


@dataclass
class FleetTraffic:
    kv_moved_tokens: int = 0  # between engines: P/D transfers, splits, moves, push backs
    tier_written_tokens: int = 0
    tier_read_tokens: int = 0
    overcommits: int = 0  # turns let in over a full cache (vLLM would preempt)
    preempted_tokens: int = 0  # recomputed for those preemptions
    admission_waits: int = 0
