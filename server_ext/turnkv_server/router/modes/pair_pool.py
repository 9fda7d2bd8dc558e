"""The pair as one pool (`turnkv` mode with `--pair-pool`): each session lives on one engine of
its prefill/decode pair, which serves the session's turns whole, as an aggregated engine would.

Why: a P/D turn keeps the session's history on both engines (the decode engine holds the
turn, the push back gives the prefill engine its copy), so under memory pressure the pair
holds half the sessions it could, and every turn that finds its history gone on either side
pays for it again. With the pool each engine holds only its own sessions (its lease,
hint-ordered eviction, its tier and the prefetch work as before, on that one engine), no KV
crosses the link and the pair holds twice as many histories. What it gives up is what P/D is
for: a long delta is computed on an engine that is decoding other sessions meanwhile, so
their inter-token latency suffers. docs/benchmarks.md measures the trade under pressure.

A new session's home is the engine of its pair home to fewer live sessions (then the one with
fewer requests in flight); the router's placement keeps it there by naming that engine as both
the session's prefill and decode engine, as it keeps an aggregated engine's sessions. A home
that goes down or is overloaded moves the session to its pair's engines, and a home is chosen
again. Sessionless turns are served by the pair as ever.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from turnkv_server.router.modes.base import DecodeAlone, TurnPlan
from turnkv_server.router.placement import Engine, Placement
from turnkv_server.router.sessions import Session, SessionKey

# The homes remembered, at most: a backstop (the router's table tells the mode of every session
# that leaves it, `Mode.forget_session`; a turn replayed after its session ended is placed once
# more).
MAX_HOMES = 100_000


class PairPool:
    def __init__(self, max_homes: int = MAX_HOMES) -> None:
        self._homes: OrderedDict[SessionKey, str] = OrderedDict()
        # Engine name -> sessions home there, kept with `_homes`: placing a session is O(1).
        self._homed: Counter[str] = Counter()
        self._max_homes = max_homes

    def __len__(self) -> int:
        return len(self._homes)

    def homed(self, engine: str) -> int:
        """How many sessions `engine` is home to."""
        return self._homed[engine]

    def plan(self, session: Session, placement: Placement, params: dict[str, Any]) -> TurnPlan:
        """The session's home serves the turn alone, under the session's lease (`params`),
        computing what its cache and tier do not hold; nothing is sent for a push back.

        The router does not tokenize the prompt, as in `affinity`: the engine's prefix cache
        finds the history by itself, and a `/tokenize` round trip per turn waits behind the
        engine's own work (with it the pool measured 10% slower than `affinity-tier` under
        pressure, without it 5%: docs/benchmarks.md). (The
        stats read as an aggregated engine's: the total from the engine's usage, no
        `prefix_break_at`; a prefetch tokenizes when it runs.) `held` False: what the engine
        computed says nothing about a short delta's backoff."""
        home = self.home(session, placement)
        return TurnPlan(Placement(home, home, placement.reason), prefill_params=None,
                        decode_params=params, alone=DecodeAlone(None, new_tokens=0, held=False))

    def home(self, session: Session, placement: Placement) -> Engine:
        """The engine that serves `session`: its home, where the placement kept it there (both
        places name it), else the one of the pair home to fewer sessions, now its home."""
        if placement.prefill is placement.decode:
            engine = placement.decode
        else:
            pair = [e for e in (placement.prefill, placement.decode) if e.healthy]
            engine = min(pair or [placement.decode],
                         key=lambda e: (self._homed[e.name], e.in_flight))
        self.forget(session.key)
        self._homes[session.key] = engine.name
        self._homed[engine.name] += 1
        while len(self._homes) > self._max_homes:
            self._uncount(self._homes.popitem(last=False)[1])
        return engine

    def forget(self, key: SessionKey) -> None:
        """The session ended, or left the router's table: it is nobody's any more."""
        home = self._homes.pop(key, None)
        if home is not None:
            self._uncount(home)

    def _uncount(self, engine: str) -> None:
        self._homed[engine] -= 1
        if not self._homed[engine]:
            del self._homed[engine]
