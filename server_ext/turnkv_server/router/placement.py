"""Which engines serve a turn: the router's pool of engines and their placement.

A session's turns stay on the pair that holds its KV while both engines are healthy
and not overloaded; a new session goes where its prefix ID is warm, else to the least loaded
pair. Warmth yields to balance: a shared system prompt is worth a few hundred tokens of
prefill, while the sessions an engine is home to decide how much KV it must hold as they
grow, so a new session leaves its warm engine when that engine is home to more than
`balance_sessions` sessions beyond the lightest one (SGLang's cache-aware router makes the same
trade with its balance thresholds). In the `standard` mode (the baseline) there is no affinity
at all: plain round robin.
An `affinity` router's pool has no prefill engines, only aggregated ones that serve turns
whole: its "pair" is one engine in both places, placed the same way.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

# "engine": an aggregated engine (affinity mode), which computes prompts and decodes.
Role = Literal["prefill", "decode", "engine"]

PlacementReason = Literal["affinity", "prefix_warm", "least_loaded", "round_robin", "moved",
                          "balanced"]


@dataclass
class Engine:
    name: str
    url: str
    role: Role
    healthy: bool = True
    in_flight: int = 0
    # Of those, the requests that have not sent a byte of their answer yet: prompts it is
    # computing, or queued to (a streamed answer starts with the first token).
    prefilling: int = 0
    consecutive_failures: int = 0
    # Its KV block size once a health probe has read it (stats explain reuse in whole blocks).
    block_size: int | None = None
    # Its KV cache's capacity in tokens, read with the block size.
    kv_tokens: int | None = None


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
    # A new session leaves its warm engine for the engine home to the fewest live sessions
    # when the warm one is home to more than this many beyond it.
    balance_sessions: int = 1
    _warm_prefixes: OrderedDict[str, tuple[str, str]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if not self.decode or (not self.prefill and not self.aggregated):
            raise ValueError("the router needs at least one prefill and one decode engine, "
                             "or aggregated engines")
        self._prefill_rr = itertools.cycle(self.prefill)
        # Every engine by name, prefill engines first (the pool's engines never change).
        self.named: dict[str, Engine] = {e.name: e for e in (*self.prefill, *self.decode)}
        self._decode_rr = itertools.cycle(self.decode)
        # Ties of least loaded aggregated engines go round: sessions that arrive while every
        # engine is idle spread instead of piling onto the first (a session stays for good).
        self._tie_rr = itertools.count()

    @property
    def aggregated(self) -> bool:
        """Aggregated engines only (affinity mode): each serves its turns whole."""
        return not self.prefill and all(e.role == "engine" for e in self.decode)

    @classmethod
    def from_urls(cls, prefill: list[str], decode: list[str], max_in_flight: int = 64,
                  engines: list[str] | None = None) -> EnginePool:
        """`engines`: aggregated engines (affinity mode), instead of prefill and decode ones;
        they serve turns where a decode engine serving alone would."""
        if engines:
            if prefill or decode:
                raise ValueError("aggregated engines go without prefill and decode engines")
            return cls(prefill=[], decode=[Engine(f"engine-{i}", u.rstrip("/"), "engine")
                                           for i, u in enumerate(engines)],
                       max_in_flight=max_in_flight)
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
        return self.named.get(name) if name is not None else None

    def round_robin(self) -> Placement:
        if self.aggregated:
            engine = self._next_healthy(self._decode_rr, self.decode)
            return Placement(engine, engine, "round_robin")
        return Placement(self._next_healthy(self._prefill_rr, self.prefill),
                         self._next_healthy(self._decode_rr, self.decode), "round_robin")

    def place(
        self, *, prefill: str | None, decode: str | None, prefix_id: str | None,
        homed: Mapping[str, int] | None = None,
    ) -> Placement:
        """Placement for a session turn; ``prefill``/``decode`` are where it ran last;
        ``homed``: how many live sessions each decode (or aggregated) engine is home to."""
        homed = homed or {}
        if self.aggregated:
            return self._place_alone(decode, prefix_id, homed)
        home_p, home_d = self.by_name(prefill), self.by_name(decode)
        if home_p and home_d and self._usable(home_p) and self._usable(home_d):
            return Placement(home_p, home_d, "affinity")
        had_home = prefill is not None or decode is not None
        balanced = False
        if not had_home and prefix_id and prefix_id in self._warm_prefixes:
            p_name, d_name = self._warm_prefixes[prefix_id]
            warm_p, warm_d = self.by_name(p_name), self.by_name(d_name)
            if warm_p and warm_d and self._usable(warm_p) and self._usable(warm_d):
                if not self._crowded(warm_d, homed):
                    return Placement(warm_p, warm_d, "prefix_warm")
                balanced = True
        p = self._least_loaded(self.prefill, prefer=home_p)
        d = self._least_loaded(self.decode, prefer=home_d, homed=homed)
        return Placement(p, d, "moved" if had_home else "balanced" if balanced
                         else "least_loaded")

    def _place_alone(self, home_name: str | None, prefix_id: str | None,
                     homed: Mapping[str, int]) -> Placement:
        """An aggregated engine for a session turn: its home while usable (its prefix cache
        holds the session), else where its prefix ID is warm (a new session) unless that
        engine is crowded, else the least loaded engine."""
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
        least = min(_load(e, homed) for e in healthy)
        tied = [e for e in healthy if _load(e, homed) == least]
        engine = tied[next(self._tie_rr) % len(tied)]
        return Placement(engine, engine, "moved" if home_name is not None
                         else "balanced" if balanced else "least_loaded")

    def unhealthy(self, *names: str | None) -> list[str]:
        """Those of the named engines that are down, each once (an affinity session names its
        engine twice)."""
        return [e.name for e in map(self.by_name, dict.fromkeys(names))
                if e is not None and not e.healthy]

    def remember_prefix(self, prefix_id: str, placement: Placement) -> None:
        self._warm_prefixes[prefix_id] = (placement.prefill.name, placement.decode.name)
        self._warm_prefixes.move_to_end(prefix_id)
        while len(self._warm_prefixes) > self.max_prefixes:
            self._warm_prefixes.popitem(last=False)

    def _usable(self, engine: Engine) -> bool:
        return engine.healthy and engine.in_flight < self.max_in_flight

    def _crowded(self, engine: Engine, homed: Mapping[str, int]) -> bool:
        """Whether `engine` is home to more than `balance_sessions` live sessions beyond the
        healthy engine (of its role) home to the fewest."""
        peers = [e for e in self.decode if e.healthy and self._usable(e)]
        fewest = min((homed.get(e.name, 0) for e in peers), default=0)
        return homed.get(engine.name, 0) > fewest + self.balance_sessions

    def _least_loaded(self, engines: list[Engine], prefer: Engine | None,
                      homed: Mapping[str, int] | None = None) -> Engine:
        # A healthy home engine keeps its role even when its partner moved: it holds KV.
        if prefer is not None and self._usable(prefer):
            return prefer
        healthy = [e for e in engines if e.healthy] or engines
        return min(healthy, key=lambda e: _load(e, homed or {}))

    @staticmethod
    def _next_healthy(cycle: itertools.cycle[Engine], engines: list[Engine]) -> Engine:
        for _ in range(len(engines)):
            engine = next(cycle)
            if engine.healthy:
                return engine
        return next(cycle)


def _load(engine: Engine, homed: Mapping[str, int]) -> tuple[int, int]:
    """Turns in flight first (now), then the live sessions it is home to (what it will hold)."""
    return engine.in_flight, homed.get(engine.name, 0)
