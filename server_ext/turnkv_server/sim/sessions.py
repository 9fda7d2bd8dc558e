"""What the simulator serves: sessions of turns, counted in tokens.

A turn appends `tokens_in` tokens to the conversation (turn 0: its whole first prompt) and
decodes `tokens_out`; `gap_s` is the tool or think time before it is sent, after the previous
turn ended. Each turn's prompt is the conversation so far: every earlier turn's input and
output, then its own input. A shared prefix (`prefix`, `prefix_tokens`: a system prompt that
many sessions start with) is found in an engine's cache by a session new there.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SimTurn:
    tokens_in: int
    tokens_out: int
    gap_s: float = 0.0


@dataclass(frozen=True)
class SimSession:
    session_id: str
    turns: tuple[SimTurn, ...]
    start_s: float = 0.0
    prefix: str | None = None
    prefix_tokens: int = 0
    parent: str | None = None  # a subagent's session: the one that started it
    # The engine (index) a replayed session was served on, where the replay knows it: the
    # pooled routers home it there, not where their own spreading would.
    home: int | None = None
    prompts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"session {self.session_id!r} has no turns")
        sizes, context = [], 0
        for turn in self.turns:
            if turn.tokens_in < 1 or turn.tokens_out < 1 or turn.gap_s < 0:
                raise ValueError(f"session {self.session_id!r}: a turn needs tokens in and out "
                                 f"and a non-negative gap, not {turn}")
            context += turn.tokens_in
            sizes.append(context)
            context += turn.tokens_out
        object.__setattr__(self, "prompts", tuple(sizes))

    def next_gap(self, turn: int) -> float | None:
        """The gap before the turn after `turn` (the client's `next_turn_in` hint); None after
        the last."""
        return self.turns[turn + 1].gap_s if turn + 1 < len(self.turns) else None

    @property
    def context_tokens(self) -> int:
        """The whole conversation: the last prompt and its output."""
        return self.prompts[-1] + self.turns[-1].tokens_out
