"""The agent loop: questions, turns, tool calls, and the cache hints that go with them.

All turns of a run are one turnkv session. Before running a tool the agent tells the router
when the next turn will come (`next_turn_in`, from that tool's measured run time), so the
router keeps the session's KV at least that long; the turn known to be the last carries
`final`, which ends the session on the router.

`Agent.run()` yields events (text as it streams, turns, tool runs) and leaves the printing
to the caller.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import turnkv

from . import prompts
from .calls import Reply, ToolCall, grammar, key_words, parse_native, parse_text
from .tools import FolderTools, ToolError


@dataclass
class AgentConfig:
    model: str
    questions: list[str]
    max_turns: int = 12
    turns_per_question: int = 3
    max_tokens: int = 96
    temperature: float = 0.0
    native_tools: bool = False  # OpenAI `tools` / `tool_calls` instead of the text format
    # Constrain replies to the text format with vLLM's structured outputs (vLLM servers only).
    # With it, a question's first reply is a tool call and its last one an answer.
    constrain: bool = False
    tool_prior_s: float = 1.0  # next_turn_in for a tool that has not run yet


@dataclass(frozen=True)
class QuestionStarted:
    index: int
    question: str


@dataclass(frozen=True)
class TurnStarted:
    index: int  # the session's turn index, as the router counts
    final: bool  # the turn carries the `final` hint
    constrained: str | None  # the structured-outputs regex, if any


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class TurnDone:
    turn: turnkv.Turn
    reply: Reply
    final: bool  # this turn carried the `final` hint


@dataclass(frozen=True)
class ToolStarted:
    call: ToolCall
    next_turn_in: float | None  # the hint sent before the run; None on a plain server


@dataclass(frozen=True)
class ToolDone:
    call: ToolCall
    result: str
    ok: bool
    seconds: float


@dataclass(frozen=True)
class Reported:
    """A reply (or tool call) the agent could not act on, told back to the model."""

    problem: str


@dataclass(frozen=True)
class Answered:
    index: int
    answer: str | None  # None: the question's turns ran out first


Event = (QuestionStarted | TurnStarted | TextDelta | TurnDone | ToolStarted | ToolDone | Reported
         | Answered)


class ToolTimer:
    """Each tool's expected run time: a moving average of its measured runs."""

    def __init__(self, prior_s: float) -> None:
        self.prior_s = prior_s
        self._mean: dict[str, float] = {}

    def estimate(self, name: str) -> float:
        return self._mean.get(name, self.prior_s)

    def record(self, name: str, seconds: float) -> None:
        old = self._mean.get(name)
        self._mean[name] = seconds if old is None else 0.7 * old + 0.3 * seconds


def next_turn_hint(tool_s: float) -> float:
    """The `next_turn_in` hint sent before a tool run: the tool's expected run time, in whole
    seconds and at least 1. The next turn also waits for the agent's own work and the request
    itself, and the hint only sets how long the router and its engines keep the session (for
    minutes anyway) and which sessions' KV an engine gives up first under memory pressure:
    "0.3 ms" would claim a precision that means nothing there."""
    return float(max(1, math.ceil(tool_s)))


@dataclass
class Agent:
    session: turnkv.Session
    tools: FolderTools
    config: AgentConfig
    folder_name: str = "."
    messages: list[dict[str, Any]] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)
    turns: int = 0
    final_sent: bool = False
    # Calls that ran, as (tool, argument): their results are in the conversation already.
    done: set[tuple[str, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.timer = ToolTimer(self.config.tool_prior_s)
        native = self.config.native_tools
        self.files = self.tools.files()
        system = prompts.system_prompt(self.tools.specs, self.folder_name, self.files,
                                       native=native)
        self.messages = [{"role": "system", "content": system},
                         *prompts.worked_example(native)]

    def run(self) -> Iterator[Event]:
        cfg = self.config
        for index, text in enumerate(cfg.questions):
            if self.turns >= cfg.max_turns:
                break
            yield QuestionStarted(index, text)
            self.messages.append(prompts.question(text))
            answer = yield from self._question(key_words(text),
                                               last_question=index == len(cfg.questions) - 1)
            self.answers.append(answer)
            yield Answered(index, answer)
        if not self.final_sent and self._served_by_turnkv():
            # Finished before the turn budget: end the session on the router now.
            self.session.hint_now(final=True)
            self.final_sent = True

    def _question(self, words: list[str], *, last_question: bool
                  ) -> Generator[Event, None, str | None]:
        cfg = self.config
        for attempt in range(cfg.turns_per_question):
            last_attempt = attempt == cfg.turns_per_question - 1
            final = self.turns + 1 >= cfg.max_turns or (last_question and last_attempt)
            if final:
                self.session.hint(final=True)
                self.final_sent = True
            rules = None
            if cfg.constrain:
                # No call the conversation already holds the result of: SmolLM2 repeats its
                # last call, question after question (it once read one file six times).
                files = [f for f in self.files if ("read_file", f) not in self.done]
                fresh = [w for w in words if ("search", w) not in self.done]
                rules = grammar(self.tools.specs, files or self.files, fresh or words,
                                must_call=attempt == 0 and not last_attempt,
                                must_answer=last_attempt)
            turn, reply = yield from self._turn(rules, final)
            yield TurnDone(turn, reply, final)
            if reply.answer is not None:
                return reply.answer
            if final:
                return None  # nothing would read a tool result after the last turn
            if reply.problem:
                yield Reported(reply.problem)
                self.messages.append(prompts.format_problem(reply.problem))
            for call in reply.calls:
                yield from self._run_tool(call)
            if attempt == cfg.turns_per_question - 2:
                self.messages.append(prompts.answer_now())
        return None

    def _turn(self, rules: str | None, final: bool
              ) -> Generator[Event, None, tuple[turnkv.Turn, Reply]]:
        cfg = self.config
        kwargs: dict[str, Any] = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
        if rules is not None:
            kwargs["extra_body"] = {"structured_outputs": {"regex": rules}}
        self.turns += 1
        yield TurnStarted(self.session.turn, final, rules)
        if cfg.native_tools:
            # Streamed tool-call deltas would need reassembling; a tool call is short anyway.
            kwargs["tools"] = [spec.json_schema() for spec in self.tools.specs.values()]
            turn = self.session.chat(messages=self.messages, model=cfg.model, **kwargs)
            if turn.text:
                yield TextDelta(turn.text)
            message: dict[str, Any] = {"role": "assistant", "content": turn.message.content}
            if turn.message.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in turn.message.tool_calls]
            self.messages.append(message)
            return turn, parse_native(turn.message, self.tools.specs)
        with self.session.stream(messages=self.messages, model=cfg.model, **kwargs) as stream:
            for chunk in stream:
                delta = chunk.choices[0].delta.content
                if delta:
                    yield TextDelta(delta)
        if stream.turn is None:
            raise turnkv.TurnKVError("the stream ended before the turn completed")
        # The reply goes back verbatim: the history the router holds must stay a prefix.
        self.messages.append({"role": "assistant", "content": stream.text})
        return stream.turn, parse_text(stream.text, self.tools.specs)

    def _run_tool(self, call: ToolCall) -> Iterator[Event]:
        native = self.config.native_tools
        if call.problem:
            yield Reported(call.problem)
            self.messages.append(prompts.tool_result(call, call.problem, ok=False, native=native))
            return
        estimate = None
        if self._served_by_turnkv():
            estimate = next_turn_hint(self.timer.estimate(call.name))
            self.session.hint_now(next_turn_in=estimate)
        yield ToolStarted(call, estimate)
        start = time.perf_counter()
        try:
            result, ok = self.tools.run(call.name, call.args), True
        except ToolError as exc:
            result, ok = str(exc), False
        seconds = time.perf_counter() - start
        self.timer.record(call.name, seconds)
        if ok:
            self.done.add((call.name, str(next(iter(call.args.values()), ""))))
        yield ToolDone(call, result, ok, seconds)
        self.messages.append(prompts.tool_result(call, result, ok=ok, native=native))

    def _served_by_turnkv(self) -> bool:
        last = self.session.last
        return last is not None and last.stats.served_by_turnkv
