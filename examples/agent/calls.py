"""How the model calls tools, and how its replies are read.

Two formats. Where the server returns OpenAI `tool_calls` (strong models behind a server with
a tool parser), the agent sends `tools` and reads `tool_calls`. Elsewhere (SmolLM2 on a plain
vLLM, which has no tool parser) the system prompt describes one line of text per reply:

    CALL read_file protocol.md
    ANSWER: the router keeps each session on the engines that hold its KV.

The parser is lenient about what small models actually write (markdown around the line, a
JSON object `{"tool": ..., "args": {...}}`, `read_file("x.md")`, trailing chatter), and a reply
it cannot read is a `problem` that goes back to the model so it can try again.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from .tools import ToolSpec


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict[str, object]
    call_id: str | None = None  # native calls: the ID the tool result must name
    problem: str | None = None  # a call that cannot run (bad arguments), told to the model

    def describe(self) -> str:
        return " ".join([self.name, *(str(v) for v in self.args.values())])


@dataclass(frozen=True)
class Reply:
    """What a reply asks for: tool calls, a final answer, or neither (`problem`)."""

    calls: list[ToolCall] = field(default_factory=list)
    answer: str | None = None
    problem: str | None = None


FORMAT_REMINDER = "Reply with one line: CALL <tool> <argument>, or ANSWER: <your answer>."

_DIRECTIVE = re.compile(r"^(CALL|ANSWER)\b\s*:?\s*(.*)$", re.IGNORECASE)
_FUNCTION_STYLE = re.compile(r"^(\w+)\s*\((.*)\)\s*$")
_DECORATION = "`*->#_ \t"


def parse_text(text: str, specs: dict[str, ToolSpec]) -> Reply:
    """Read the first directive of a reply: a CALL line, a JSON tool object or ANSWER:."""
    lines = text.splitlines()
    for number, raw in enumerate(lines):
        line = raw.strip().strip(_DECORATION)
        match = _DIRECTIVE.match(line)
        if match and match.group(1).upper() == "ANSWER":
            rest = "\n".join([match.group(2), *lines[number + 1:]]).strip()
            return Reply(answer=rest) if rest else Reply(problem="the ANSWER: line is empty")
        if match:
            return _parse_call(match.group(2), specs)
        if line.startswith("{"):
            found = _json_call(line, specs)
            if found is not None:
                return found
    return Reply(problem="the reply has no CALL line and no ANSWER: line")


def parse_native(message: Any, specs: dict[str, ToolSpec]) -> Reply:
    """Read an OpenAI assistant message. Without `tool_calls`, the text is read as in the
    textual format, and plain prose counts as the answer (OpenAI's convention)."""
    calls = []
    for item in getattr(message, "tool_calls", None) or []:
        name = item.function.name
        try:
            args = json.loads(item.function.arguments or "{}")
            problem = None if isinstance(args, dict) else "arguments must be a JSON object"
        except ValueError as exc:
            args, problem = {}, f"arguments are not valid JSON ({exc})"
        if name not in specs:
            problem = f"unknown tool {name!r}; the tools are {', '.join(specs)}"
        calls.append(ToolCall(name, args if isinstance(args, dict) else {}, item.id, problem))
    if calls:
        return Reply(calls=calls)
    text = (getattr(message, "content", None) or "").strip()
    reply = parse_text(text, specs)
    if reply.problem and text:
        return Reply(answer=text)
    return reply


def _parse_call(rest: str, specs: dict[str, ToolSpec]) -> Reply:
    rest = rest.strip().strip(_DECORATION)
    function_style = _FUNCTION_STYLE.match(rest)
    if function_style:
        name = function_style.group(1)
        tokens = [t.strip().strip("'\"") for t in function_style.group(2).split(",") if t.strip()]
    else:
        try:
            words = shlex.split(rest)
        except ValueError:  # an unbalanced quote
            words = rest.split()
        if not words:
            return Reply(problem="the CALL line names no tool")
        name, tokens = words[0], words[1:]
    spec = specs.get(name)
    if spec is None:
        return Reply(problem=f"unknown tool {name!r}; the tools are {', '.join(specs)}")
    args: dict[str, object] = {}
    for param, token in zip(spec.params, tokens, strict=False):
        key, sep, value = token.partition("=")
        if sep and key in spec.params:
            param, token = key, value
        if param == "line" and not token.isdigit():
            break  # trailing words after the path, not a line number
        args[param] = token.strip("`'\"")
    return Reply(calls=[ToolCall(name, args)])


def _json_call(line: str, specs: dict[str, ToolSpec]) -> Reply | None:
    try:
        data, _ = json.JSONDecoder().raw_decode(line)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("tool") or data.get("name"), str):
        return None
    name = str(data.get("tool") or data.get("name"))
    args = data.get("args") or data.get("arguments") or data.get("parameters") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = {}
    if name not in specs:
        return Reply(problem=f"unknown tool {name!r}; the tools are {', '.join(specs)}")
    if not isinstance(args, dict):
        return Reply(problem="the tool's args must be a JSON object")
    return Reply(calls=[ToolCall(name, args)])


def grammar(specs: dict[str, ToolSpec], files: list[str], words: list[str], *,
            must_call: bool, must_answer: bool) -> str:
    """A regex for vLLM's structured outputs that admits only well-formed replies: one call,
    or a one-line answer. Calls are held to arguments that make sense: read_file names a file
    that exists, search looks for a word of the question, list_files lists the whole folder.
    Left a free argument, SmolLM2-135M wrote `list_list_list...` until max_tokens.

    Unbounded repeats only: the engine compiles the regex into an automaton, and counted
    repeats like {1,400} blow it up (compiling timed out on a busy 2-core host); `max_tokens`
    bounds the length instead."""
    def choice(options: list[str], fallback: str) -> str:
        if not 0 < len(options) <= 100:
            return fallback
        return "(" + "|".join(re.escape(option) for option in options) + ")"

    args = {"read_file": choice(files, r"[A-Za-z0-9_.][A-Za-z0-9_./-]*"),
            "search": choice(words, "[A-Za-z]+"), "list_files": r"\."}
    anything = r"[^ \n]+"
    calls = {name: f"CALL {re.escape(name)} {args.get(name, anything)}" for name in specs}
    call = "|".join(calls.values())
    answer = r"ANSWER: [A-Za-z][^\n]+"  # words, not the "1: 1: 1:" of a numbered listing
    if must_call:
        # The system prompt lists the files already: a first look that lists them again
        # learns nothing (and is what SmolLM2 picked, question after question).
        looks = [pattern for name, pattern in calls.items() if name != "list_files"]
        return f"({'|'.join(looks)})"
    if must_answer:
        return answer
    return f"({call}|{answer})"


_COMMON = frozenset([
    "about", "after", "also", "and", "are", "does", "during", "from", "have", "into", "local",
    "one", "that", "the", "their", "them", "then", "there", "these", "they", "this", "what",
    "when", "where", "which", "while", "will", "with", "would", "your",
])


def key_words(question: str) -> list[str]:
    """The words of a question worth searching for, in order."""
    seen: dict[str, None] = {}
    for word in re.findall(r"[A-Za-z][A-Za-z_-]{3,}", question):
        if word.lower() not in _COMMON:
            seen.setdefault(word.lower(), None)
    return list(seen)
