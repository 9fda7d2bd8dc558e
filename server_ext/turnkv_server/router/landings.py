"""Turns landing on the pair's engines, and the prompts held back from those engines meanwhile
(`Landings`): the `turnkv` mode's guard of what moves KV against the prompts sent after it.

A turn that moves KV has a part on each engine it uses: the engine that computes its prompt
(a split's helper, a pulling move's old home) until that prompt is answered, and the engine
that decodes it until its first token, at that engine's first step after the KV has landed.
vLLM schedules the requests that are ready, first come first served among them, and both
parts may not be ready when a later prompt arrives: the decoding engine's request waits for
the KV, and a prompt that reads part of itself from the shared tier is passed over for a step
while vLLM's tiering promotes the read (it answers the lookup "pending" and looks again at the
next step). A long prompt sent after the turn then starts first and holds the part for all of
its compute: vLLM computes up to `max_num_batched_tokens` prompt tokens in one step, seconds
on a CPU, and the turn that was planned to land in one step waits for that one.

The router knows both. A prompt that would hold a part on its engine longer than it would
wait for the part (its estimated compute more than the part's time left, as planned) is held
back until the part is done, and never longer than its own compute: beyond that it would lose
more than the part gains. The clock is the mode's; the table is bounded, and a part whose end
is never told is forgotten once it is long overdue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

from turnkv_server.router.decisions import Decision

# Parts kept at most (a backstop: every part ends at its turn's first token or end).
MAX_PARTS = 10_000
# A part this long past its due time is forgotten: it is stuck, or its turn's end was never
# told (an attempt that failed before its decode request went out gets no `finish`); the
# prompts it would hold go their way. Longer than the planner's estimates err by on a CPU.
OVERDUE_S = 10.0


@dataclass
class _Part:
    engine: str
    due_s: float  # when the planner expected it done (the mode's clock)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Landings:
    """The parts of the turns that move KV, by turn: the computing engine's until its prompt
    is answered (`prefilled`), the decoding engine's until its first token or its end (`end`)."""

    def __init__(self, clock: Callable[[], float], max_parts: int = MAX_PARTS) -> None:
        self._clock = clock
        self._max_parts = max_parts
        # By turn: its computing part (None where one engine does both) and its landing part.
        # Read as a plain attribute on every turn: empty, the mode enters no call here.
        self.parts: dict[Hashable, tuple[_Part | None, _Part]] = {}

    def begin(self, turn: Hashable, decision: Decision) -> None:
        """A turn that moves KV (`decision`) is sent now: its prompt computed on
        `decision.prefill` and its first token on `decision.home` when the planner expects
        (its estimates `prefill_done_ms` and `ttft_ms`; a move not weighed has only its
        prompt's compute, `compute_ms`)."""
        now, estimates = self._clock(), decision.estimates
        self.end(turn)  # an attempt replanned: the last one's parts are over
        self._forget_overdue(now)
        while len(self.parts) >= self._max_parts:
            self.end(next(iter(self.parts)))
        compute_ms = estimates.get("compute_ms", 0.0)
        computing = (_Part(decision.prefill,
                           now + estimates.get("prefill_done_ms", compute_ms) / 1000)
                     if decision.prefill != decision.home else None)
        landing = _Part(decision.home, now + estimates.get("ttft_ms", compute_ms) / 1000)
        self.parts[turn] = (computing, landing)

    def prefilled(self, turn: Hashable) -> None:
        """The turn's prompt was answered: its computing engine's part is done."""
        computing = self.parts.get(turn, (None, None))[0]
        if computing is not None:
            computing.done.set()

    def end(self, turn: Hashable) -> None:
        """The turn's first token came, or the turn ended: all of its parts are done."""
        for part in self.parts.pop(turn, ()):
            if part is not None:
                part.done.set()

    async def hold(self, decision: Decision) -> Decision:
        """The turn `decision` places, about to compute its prompt on `decision.prefill` in
        about `estimates["compute_ms"]`: held while a part on that engine with less time left
        than that is not done, that long at most. Its decision says how long it waited."""
        engine, compute_ms = decision.prefill, decision.estimates.get("compute_ms", 0.0)
        started = self._clock()
        self._forget_overdue(started)
        waits = [part.done.wait() for part in self._on(engine)
                 if not part.done.is_set() and (part.due_s - started) * 1000 < compute_ms]
        if not waits:
            return decision
        tasks = [asyncio.ensure_future(wait) for wait in waits]
        try:
            await asyncio.wait(tasks, timeout=compute_ms / 1000)
        finally:
            for task in tasks:
                task.cancel()
        held_ms = (self._clock() - started) * 1000
        turns = "a turn" if len(tasks) == 1 else f"{len(tasks)} turns"
        return replace(decision, why=f"{decision.why}; held {held_ms:.0f} ms for {turns} "
                                     f"landing on {engine}",
                       estimates={**decision.estimates, "held_ms": round(held_ms, 2)})

    def left_ms(self, engine: str) -> tuple[float, ...]:
        """The time each part on `engine` not done has left as planned (0: overdue)."""
        now = self._clock()
        return tuple(max(0.0, (part.due_s - now) * 1000) for part in self._on(engine)
                     if not part.done.is_set())

    def _on(self, engine: str) -> list[_Part]:
        return [part for parts in self.parts.values() for part in parts
                if part is not None and part.engine == engine]

    def _forget_overdue(self, now: float) -> None:
        overdue = [turn for turn, (_, landing) in self.parts.items()
                   if now - landing.due_s > OVERDUE_S]
        for turn in overdue:
            self.end(turn)
