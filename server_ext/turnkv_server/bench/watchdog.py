"""Stall detection: a mode that makes no progress while turns wait on it is stopped.

Progress is an output chunk from any session. Silence alone is not a stall: while every
session sleeps through its tool time no turn is in flight and nothing is expected. The clock
of "no progress" therefore starts at the later of the last chunk and the moment turns were
last put in flight with none before them.

Upstream bidirectional P/D deadlocked under memory pressure in an earlier measurement
(SmolLM2, one core per engine, sessions whose context outgrew the KV cache): both engines at
zero throughput with requests waiting for capacity. That is what this catches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Watchdog:
    """Tracks in-flight turns and the last progress; `stalled()` says when to give up."""

    stall_timeout_s: float
    clock: Callable[[], float] = time.monotonic
    in_flight: int = 0
    last_progress: float = field(default=0.0)

    def __post_init__(self) -> None:
        if self.stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be positive")
        self.last_progress = self.clock()

    def turn_started(self) -> None:
        """A turn's request is about to be sent."""
        if self.in_flight == 0:
            # Nothing was expected until now: the silence before this turn is not a stall.
            self.last_progress = self.clock()
        self.in_flight += 1

    def progress(self) -> None:
        """An output chunk arrived."""
        self.last_progress = self.clock()

    def turn_ended(self) -> None:
        """A turn finished, failed or was cancelled."""
        self.in_flight = max(0, self.in_flight - 1)

    def silent_for(self) -> float:
        """Seconds since the last progress, counted only while turns are in flight."""
        if self.in_flight == 0:
            return 0.0
        return self.clock() - self.last_progress

    def stalled(self) -> bool:
        """True once turns have waited `stall_timeout_s` without any chunk from any session."""
        return self.silent_for() >= self.stall_timeout_s
