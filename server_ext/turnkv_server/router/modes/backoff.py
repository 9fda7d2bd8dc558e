"""Per-engine backoffs: after a miss, an engine is avoided for a while, twice as long after
each further miss (up to a cap), and no longer once a try succeeds."""

from __future__ import annotations

from collections.abc import Callable


class Backoff:
    def __init__(self, first_s: float, max_s: float, clock: Callable[[], float]) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._clock = clock
        # Engine name -> (until when it is avoided, the current backoff).
        self._until: dict[str, tuple[float, float]] = {}

    def active(self, engine: str) -> bool:
        until, _ = self._until.get(engine, (0.0, 0.0))
        return self._clock() < until

    def record(self, engine: str, missed: bool) -> float | None:
        """A try on `engine` missed (start or double its backoff: returns its length in
        seconds) or succeeded (end it: None)."""
        if not missed:
            self._until.pop(engine, None)
            return None
        _, backoff = self._until.get(engine, (0.0, self.first_s / 2))
        backoff = min(backoff * 2, self.max_s)
        self._until[engine] = (self._clock() + backoff, backoff)
        return backoff
