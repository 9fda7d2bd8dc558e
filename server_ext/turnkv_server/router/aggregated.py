"""The pool of aggregated engines (`affinity` mode): no prefill engines, only engines that
serve turns whole, so a session's "pair" is one engine in both places. It is placed as a pair
is (`engines.EnginePool`): its home while usable, else where its prefix ID is warm unless that
engine is crowded, else the least loaded engine, ties going round.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from turnkv_server.router.engines import Engine, EnginePool, Placement, load_of


class AggregatedPool(EnginePool):
    def __post_init__(self) -> None:
        super().__post_init__()
        # Ties of least loaded aggregated engines go round: sessions that arrive while every
        # engine is idle spread instead of piling onto the first (a session stays for good).
        self._tie_rr = itertools.count()

    @classmethod
    def of(cls, engines: list[str], max_in_flight: int = 64) -> AggregatedPool:
        """Aggregated engines, which serve turns where a decode engine serving alone would."""
        return cls(prefill=[], decode=[Engine(f"engine-{i}", u.rstrip("/"), "engine")
                                       for i, u in enumerate(engines)],
                   max_in_flight=max_in_flight)

    def round_robin(self) -> Placement:
        engine = self._next_healthy(self._decode_rr, self.decode)
        return Placement(engine, engine, "round_robin")

    def place(
        self, *, prefill: str | None, decode: str | None, prefix_id: str | None,
        homed: Mapping[str, int] | None = None,
    ) -> Placement:
        """An aggregated engine for a session turn: its home while usable (its prefix cache
        holds the session), else where its prefix ID is warm (a new session) unless that
        engine is crowded, else the least loaded engine. (`prefill` names the same engine as
        `decode`.)"""
        home_name, homed = decode, homed or {}
        home = self.by_name(home_name)
        if home is not None and self._usable(home):
            return Placement(home, home, "affinity")
        balanced = False
        if home_name is None and prefix_id and prefix_id in self._warm_prefixes:
            warm = self.by_name(self._warm_prefixes[prefix_id][1])
            if warm is not None and self._usable(warm):
                if not self._crowded(warm, homed):
                    return Placement(warm, warm, "prefix_warm")
                balanced = True
        healthy = [e for e in self.decode if e.healthy] or self.decode
        least = min(load_of(e, homed) for e in healthy)
        tied = [e for e in healthy if load_of(e, homed) == least]
        engine = tied[next(self._tie_rr) % len(tied)]
        return Placement(engine, engine, "moved" if home_name is not None
                         else "balanced" if balanced else "least_loaded")


def engine_pool(prefill: list[str], decode: list[str], engines: list[str] | None = None
                ) -> EnginePool:
    """The router's pool from its configured URLs: `engines`, aggregated ones (affinity mode),
    or prefill and decode ones."""
    if engines:
        if prefill or decode:
            raise ValueError("aggregated engines go without prefill and decode engines")
        return AggregatedPool.of(engines)
    return EnginePool.from_urls(prefill, decode)
