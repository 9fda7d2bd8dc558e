"""Leases expire on time on an idle engine too: a timer thread wakes the engine at a deadline.
(So do quarantined receive blocks come back: `holds.BlockHolder.next_wake`.)

vLLM's engine core blocks on its input queue when it has no work, so no connector callback
runs. The scheduler half's `has_pending_push_work` (which vLLM asks before blocking) says yes
only while a lease is past its deadline, and `IdleExpiry` arms a timer thread (`WakeAlarm`)
that puts a wake-up message on that queue at the next deadline. The engine then steps once,
the step's `build_orders` frees the lease's blocks, and the engine sleeps again: a lease
outlives its TTL by the timer's latency plus one (empty) step. The timer thread only reads a
time; it never touches the block pool. Without a queue to wake (an in-process engine core,
which its caller steps), expiry runs at the next step.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class WakeAlarm:
    """Calls `wake` from its own thread once the monotonic clock reaches the time last `set`
    (one call per time set). It reads nothing else and touches nothing else: the engine-core
    thread, once woken, does the work."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._at = math.inf
        self._closed = False
        self._failed = False
        self._cond = threading.Condition()
        # Started now, inside the engine's start-up, so that it runs where the engine's other
        # threads run (the launcher pins every engine thread to the engine's cores).
        self._thread = threading.Thread(target=self._run, name="turnkv-lease-alarm",
                                        daemon=True)
        self._thread.start()

    def set(self, at: float) -> None:
        with self._cond:
            self._at = at
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (delay := self._at - time.monotonic()) > 0:
                    self._cond.wait(None if delay == math.inf else delay)
                if self._closed:
                    return
                self._at = math.inf  # the engine sets the next deadline once it has stepped
            try:
                self._wake()
            except Exception:  # the engine then expires leases at its next step
                if not self._failed:
                    log.exception("turnkv: could not wake the engine for lease expiry")
                    self._failed = True


class IdleExpiry:
    """The scheduler half's alarm: set to the next lease deadline whenever it changes."""

    def __init__(self) -> None:
        self._alarm: WakeAlarm | None = None
        self._armed = math.inf

    def bind(self, wake: Callable[[], None] | None) -> None:
        """`wake` (called from the alarm's thread) makes an idle engine step; None: no alarm,
        leases expire at the engine's next step."""
        if self._alarm is not None:
            self._alarm.close()
        self._alarm = WakeAlarm(wake) if wake is not None else None
        self._armed = math.inf

    def arm(self, at: float) -> None:
        """Tell the alarm the next deadline (a lease's, or a quarantine's check), if it
        changed."""
        if self._alarm is None:
            return
        if at != self._armed:
            self._armed = at
            self._alarm.set(at)

    def close(self) -> None:
        if self._alarm is not None:
            self._alarm.close()
            self._alarm = None
