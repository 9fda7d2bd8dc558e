"""What the sessions' leases hold on each engine, as the router counts it: the planner's view
of memory pressure (`planner.EngineLoad.room_tokens`).

The router knows each session's history and where copies of it live (it placed every turn),
so it can tell, without asking the engines, how much of each cache the leases hold and how
much room is left before a new prompt would end one. The count errs high: a lease the engine
ended under pressure, or that expired, still counts until its session ends or is forgotten,
which makes the planner keep turns whole a little sooner than it must.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

# Of an engine's cache, the share leases may hold before it counts as full: the rest is
# the running requests' (their prompts and the blocks they grow into).
LEASE_SHARE = 0.9


class Holdings:
    def __init__(self) -> None:
        self._by_session: dict[Hashable, dict[str, int]] = {}
        self._by_engine: dict[str, int] = {}

    def hold(self, session: Hashable, tokens_by_engine: Mapping[str, int]) -> None:
        """The session's leases now hold these tokens on these engines (and none elsewhere)."""
        self.drop(session)
        held = {engine: tokens for engine, tokens in tokens_by_engine.items() if tokens > 0}
        if held:
            self._by_session[session] = held
        for engine, tokens in held.items():
            self._by_engine[engine] = self._by_engine.get(engine, 0) + tokens

    def drop(self, session: Hashable) -> None:
        for engine, tokens in self._by_session.pop(session, {}).items():
            self._by_engine[engine] -= tokens

    def held(self, engine: str) -> int:
        return self._by_engine.get(engine, 0)

    def room(self, engine: str, capacity_tokens: int | None) -> int | None:
        """Tokens `engine` can take without ending a lease; None where its size is unknown."""
        if capacity_tokens is None:
            return None
        return max(0, int(capacity_tokens * LEASE_SHARE) - self.held(engine))
