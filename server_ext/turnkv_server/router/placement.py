"""Which prefill/decode pair serves a turn.

A session's turns stay on the pair that holds its KV while both engines are healthy and not
overloaded; a new session goes where its prefix ID is warm, else to the least loaded pair.
In the `standard` mode (the baseline) there is no affinity at all: plain round robin.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["prefill", "decode"]

PlacementReason = Literal["affinity", "prefix_warm", "least_loaded", "round_robin", "moved"]


@dataclass
class Engine:
    name: str
    url: str
    role: Role
    healthy: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0


@dataclass(frozen=True)
class Placement:
    prefill: Engine
    decode: Engine
    reason: PlacementReason


@dataclass
class EnginePool:
    prefill: list[Engine]
    decode: list[Engine]
    # A pair is overloaded when one of its engines has this many turns in flight.
    max_in_flight: int = 64
    max_prefixes: int = 4096
    _warm_prefixes: OrderedDict[str, tuple[str, str]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one prefill and one decode engine")
        self._prefill_rr = itertools.cycle(self.prefill)
        self._decode_rr = itertools.cycle(self.decode)

    @classmethod
    def from_urls(cls, prefill: list[str], decode: list[str], max_in_flight: int = 64
                  ) -> EnginePool:
        return cls(
            prefill=[Engine(f"prefill-{i}", u.rstrip("/"), "prefill")
                     for i, u in enumerate(prefill)],
            decode=[Engine(f"decode-{i}", u.rstrip("/"), "decode")
                    for i, u in enumerate(decode)],
            max_in_flight=max_in_flight,
        )

    def engines(self) -> list[Engine]:
        return [*self.prefill, *self.decode]

    def by_name(self, name: str | None) -> Engine | None:
        return next((e for e in self.engines() if e.name == name), None)

    def round_robin(self) -> Placement:
        return Placement(self._next_healthy(self._prefill_rr, self.prefill),
                         self._next_healthy(self._decode_rr, self.decode), "round_robin")

    def place(
        self, *, prefill: str | None, decode: str | None, prefix_id: str | None
    ) -> Placement:
        """Placement for a session turn; ``prefill``/``decode`` are where it ran last."""
        home_p, home_d = self.by_name(prefill), self.by_name(decode)
        if home_p and home_d and self._usable(home_p) and self._usable(home_d):
            return Placement(home_p, home_d, "affinity")
        had_home = prefill is not None or decode is not None
        if not had_home and prefix_id and prefix_id in self._warm_prefixes:
            p_name, d_name = self._warm_prefixes[prefix_id]
            warm_p, warm_d = self.by_name(p_name), self.by_name(d_name)
            if warm_p and warm_d and self._usable(warm_p) and self._usable(warm_d):
                return Placement(warm_p, warm_d, "prefix_warm")
        p = self._least_loaded(self.prefill, prefer=home_p)
        d = self._least_loaded(self.decode, prefer=home_d)
        return Placement(p, d, "moved" if had_home else "least_loaded")

    def remember_prefix(self, prefix_id: str, placement: Placement) -> None:
        self._warm_prefixes[prefix_id] = (placement.prefill.name, placement.decode.name)
        self._warm_prefixes.move_to_end(prefix_id)
        while len(self._warm_prefixes) > self.max_prefixes:
            self._warm_prefixes.popitem(last=False)

    def _usable(self, engine: Engine) -> bool:
        return engine.healthy and engine.in_flight < self.max_in_flight

    def _least_loaded(self, engines: list[Engine], prefer: Engine | None) -> Engine:
        # A healthy home engine keeps its role even when its partner moved: it holds KV.
        if prefer is not None and self._usable(prefer):
            return prefer
        healthy = [e for e in engines if e.healthy] or engines
        return min(healthy, key=lambda e: e.in_flight)

    @staticmethod
    def _next_healthy(cycle: itertools.cycle[Engine], engines: list[Engine]) -> Engine:
        for _ in range(len(engines)):
            engine = next(cycle)
            if engine.healthy:
                return engine
        return next(cycle)
