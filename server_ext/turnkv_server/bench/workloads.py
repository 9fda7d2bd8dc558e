"""Benchmark workloads: the data model, and seeded generation of agent and chat sessions.

A `Workload` is plain data shared by the runner and the results: sessions of turns, each turn
the message appended to the conversation (a user request or a tool result), its output length
and the client's or tool's time before it is sent. The assistant's replies are whatever the
model answers, so they are not part of the workload.

Generation is seeded with numpy: session `i` draws from its own stream `(seed, i)`, so adding
sessions leaves the earlier ones unchanged, and arrivals draw from a separate stream.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from turnkv.protocol import SessionId
from turnkv_server.bench import prompts
from turnkv_server.bench.corpus import Corpus, load_corpus
from turnkv_server.bench.sizing import MESSAGE_OVERHEAD_TOKENS, TokenCounter, approx_tokens
from turnkv_server.bench.tool_outputs import tool_output

# Arrival times draw from this stream of the seed, apart from every session's stream.
_ARRIVAL_STREAM = 2**32 - 1


class TurnSpec(BaseModel):
    """One turn of a session: the message appended, its output length, the wait before it."""

    model_config = ConfigDict(extra="forbid")

    user: str = Field(min_length=1)
    # "tool": a tool result; a runner without tool parsing sends it as a user message.
    role: Literal["user", "tool"]
    max_tokens: int = Field(ge=1)
    think_time_s: float = Field(ge=0.0)


class SessionSpec(BaseModel):
    """One conversation: a system prompt, the tools it describes, turns, and when it starts."""

    model_config = ConfigDict(extra="forbid")

    session_id: SessionId
    system: str
    tools: list[dict[str, Any]] | None = None
    turns: list[TurnSpec] = Field(min_length=1)
    start_s: float = Field(default=0.0, ge=0.0)

    @model_validator(mode="after")
    def _starts_with_user(self) -> SessionSpec:
        first = self.turns[0]
        if first.role != "user":
            raise ValueError("the first turn must be a user message (a tool result answers a "
                             "call the model made)")
        if first.think_time_s != 0.0:
            raise ValueError("the first turn's think_time_s must be 0 (start_s says when the "
                             "session begins)")
        return self


class Workload(BaseModel):
    """Sessions to run, closed-loop (`concurrency` at a time) or open-loop by `start_s`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    seed: int
    kind: Literal["agent", "chat", "trace"]
    sessions: list[SessionSpec] = Field(min_length=1)
    concurrency: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> Workload:
        seen: set[str] = set()
        for s in self.sessions:
            if s.session_id in seen:
                raise ValueError(f"session_id {s.session_id!r} appears twice")
            seen.add(s.session_id)
        return self


class WorkloadParams(BaseModel):
    """Every knob of a generated workload; `presets` has named sets of them.

    Sizes are in tokens as `count_tokens` counts them. Tool results follow a lognormal
    distribution (median `tool_result_median`, shape `tool_result_sigma`) clipped to
    `tool_result_tokens`; think times a lognormal (median `think_time_median_s`, shape
    `think_time_sigma`) clipped at `think_time_max_s`, then multiplied by `think_time_scale`.
    Turn counts, user message sizes and output lengths are uniform over their ranges.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: Literal["agent", "chat"]
    # numpy seeds are non-negative.
    seed: int = Field(default=0, ge=0)
    sessions: int = Field(ge=1)
    turns: tuple[int, int]
    system_tokens: int = Field(ge=1)
    # Agent only: how many tool schemas the system prompt and `tools` carry (3 to 8).
    tool_count: int = 6
    tool_result_tokens: tuple[int, int] = (100, 2000)
    tool_result_median: float = Field(default=350.0, gt=0)
    tool_result_sigma: float = Field(default=0.9, ge=0)
    user_tokens: tuple[int, int] = (20, 120)
    # Agent only: the chance that a later turn is the user's follow-up, not a tool result.
    follow_up_prob: float = Field(default=0.1, ge=0, le=1)
    output_tokens: tuple[int, int] = (16, 64)
    think_time_median_s: float = Field(default=0.5, ge=0)
    think_time_sigma: float = Field(default=1.0, ge=0)
    think_time_max_s: float = Field(default=20.0, ge=0)
    think_time_scale: float = Field(default=1.0, ge=0)
    # Exactly one: closed loop with this many sessions at once, or Poisson arrivals per second.
    concurrency: int | None = Field(default=None, ge=1)
    arrival_rate: float | None = Field(default=None, gt=0)
    # A session ends early rather than outgrow the model's context (estimated, outputs counted
    # at max_tokens). None: no limit.
    max_context_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadParams:
        for field in ("turns", "tool_result_tokens", "user_tokens", "output_tokens"):
            lo, hi = getattr(self, field)
            if not 1 <= lo <= hi:
                raise ValueError(f"{field} must be (min, max) with 1 <= min <= max, not "
                                 f"{(lo, hi)}")
        if (self.concurrency is None) == (self.arrival_rate is None):
            raise ValueError("set exactly one of concurrency (closed loop) and arrival_rate "
                             "(Poisson arrivals)")
        return self


def generate(params: WorkloadParams, count_tokens: TokenCounter = approx_tokens,
             corpus: Corpus | None = None) -> Workload:
    """The workload `params` describe; the same params and corpus give the same workload."""
    gen = SessionGenerator(params, count_tokens, corpus)
    return gen.workload([gen.session(i) for i in range(params.sessions)])


class SessionGenerator:
    """Makes the sessions of one parameter set, one at a time (see `presets.memory_pressure`)."""

    def __init__(self, params: WorkloadParams, count_tokens: TokenCounter = approx_tokens,
                 corpus: Corpus | None = None) -> None:
        self.params = params
        self.count = count_tokens
        self.corpus = corpus if corpus is not None else load_corpus()
        self.tools = prompts.tool_schemas(params.tool_count) if params.kind == "agent" else None
        self.system = prompts.system_prompt(self.corpus, self.tools, params.system_tokens,
                                            count_tokens)
        self.system_size = count_tokens(self.system) + MESSAGE_OVERHEAD_TOKENS

    def session(self, index: int) -> SessionSpec:
        """Session `index`, drawn from its own random stream; `start_s` is set by `workload`."""
        p = self.params
        rng = np.random.default_rng([p.seed, index])
        wanted = int(rng.integers(p.turns[0], p.turns[1] + 1))
        budget = p.max_context_tokens - self.system_size if p.max_context_tokens else None
        turns: list[TurnSpec] = []
        for t in range(wanted):
            max_tokens = int(rng.integers(p.output_tokens[0], p.output_tokens[1] + 1))
            # What the turn may use: its message, its output, and two messages' markup.
            room = None if budget is None else budget - max_tokens - 2 * MESSAGE_OVERHEAD_TOKENS
            turn = self._turn(rng, t, max_tokens, room)
            if turn is None:
                break
            turns.append(turn)
            if budget is not None:
                budget -= self.count(turn.user) + max_tokens + 2 * MESSAGE_OVERHEAD_TOKENS
        if not turns:
            raise ValueError(f"max_context_tokens={p.max_context_tokens} leaves no room for a "
                             f"first turn after the {self.system_size}-token system prompt")
        return SessionSpec(session_id=f"{p.name}-{p.seed}-{index:04d}", system=self.system,
                           tools=self.tools, turns=turns)

    def workload(self, sessions: list[SessionSpec]) -> Workload:
        """The workload of these sessions, with their start times set."""
        p = self.params
        starts = arrival_times(p.seed, len(sessions), p.arrival_rate)
        timed = [s.model_copy(update={"start_s": t}) for s, t in zip(sessions, starts, strict=True)]
        return Workload(name=p.name, seed=p.seed, kind=p.kind, sessions=timed,
                        concurrency=p.concurrency)

    def _turn(self, rng: np.random.Generator, t: int, max_tokens: int,
              room: int | None) -> TurnSpec | None:
        p = self.params
        think = 0.0 if t == 0 else self._think_time(rng)
        tool = p.kind == "agent" and t > 0 and rng.random() >= p.follow_up_prob
        if tool:
            target = _clipped_lognormal(rng, p.tool_result_median, p.tool_result_sigma,
                                        *p.tool_result_tokens)
            lo = p.tool_result_tokens[0]
        else:
            target = int(rng.integers(p.user_tokens[0], p.user_tokens[1] + 1))
            lo = p.user_tokens[0]
        if room is not None:
            if room < lo:
                return None
            target = min(target, room)
        if tool:
            text = tool_output(rng, self.corpus, round(target), self.count)
            return TurnSpec(user=text, role="tool", max_tokens=max_tokens, think_time_s=think)
        kind = "question" if p.kind == "chat" else "task" if t == 0 else "follow_up"
        text = prompts.user_message(rng, self.corpus, kind, round(target), self.count)
        return TurnSpec(user=text, role="user", max_tokens=max_tokens, think_time_s=think)

    def _think_time(self, rng: np.random.Generator) -> float:
        p = self.params
        raw = _clipped_lognormal(rng, p.think_time_median_s, p.think_time_sigma,
                                 0.0, p.think_time_max_s)
        return round(raw * p.think_time_scale, 3)


def arrival_times(seed: int, n: int, rate: float | None) -> list[float]:
    """Start offsets: all 0 for a closed loop, else a Poisson process of `rate` from 0."""
    if rate is None:
        return [0.0] * n
    rng = np.random.default_rng([seed, _ARRIVAL_STREAM])
    gaps = rng.exponential(1.0 / rate, size=n)
    starts = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    return [round(float(t), 3) for t in starts]


def total_context_tokens(workload: Workload, count_tokens: TokenCounter = approx_tokens) -> int:
    """KV tokens needed to hold every session's full context at once, with shared prefixes.

    Each distinct system prompt counts once (a prefix cache shares it); every turn's message
    and its output (at `max_tokens`) count per session, with chat-template markup.
    """
    systems = {s.system for s in workload.sessions}
    total = sum(count_tokens(text) + MESSAGE_OVERHEAD_TOKENS for text in systems)
    for s in workload.sessions:
        total += sum(count_tokens(t.user) + t.max_tokens + 2 * MESSAGE_OVERHEAD_TOKENS
                     for t in s.turns)
    return total


def _clipped_lognormal(rng: np.random.Generator, median: float, sigma: float, lo: float,
                       hi: float) -> float:
    return float(np.clip(median * np.exp(sigma * rng.standard_normal()), lo, hi))
