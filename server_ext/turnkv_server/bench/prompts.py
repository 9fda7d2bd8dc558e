"""The words of a session: system prompts with tool schemas, and user messages.

The tool schemas are OpenAI function definitions of a coding agent's tools; the system prompt
describes the same tools in text, so that models and servers without tool parsers see them too.
User messages are task-like templates filled with corpus words, padded to a size with quoted
corpus text (a user pasting context).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from turnkv_server.bench.corpus import Corpus
from turnkv_server.bench.sizing import TokenCounter, take_tokens


def _tool(name: str, description: str, params: dict[str, tuple[str, str]],
          required: tuple[str, ...]) -> dict[str, Any]:
    # params: name -> (JSON type, description)
    props = {p: {"type": kind, "description": text} for p, (kind, text) in params.items()}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": list(required)}}}


# The first three produce every tool result (see tool_outputs); the rest make the schema text
# as long as real agents' are.
TOOL_SCHEMAS: tuple[dict[str, Any], ...] = (
    _tool("list_files", "List the files under a folder, with sizes and line counts.",
          {"folder": ("string", "folder, relative to the repository root")}, ()),
    _tool("read_file", "Show a file with line numbers, from line 1 or from the given line.",
          {"path": ("string", "file, relative to the repository root"),
           "line": ("integer", "first line to show")}, ("path",)),
    _tool("search", "Show every line of every file that contains the pattern.",
          {"pattern": ("string", "a word or an exact string")}, ("pattern",)),
    _tool("write_file", "Replace a file's content; creates the folders it needs.",
          {"path": ("string", "file to write"), "content": ("string", "the whole new text")},
          ("path", "content")),
    _tool("edit_file", "Replace the first occurrence of a string in a file.",
          {"path": ("string", "file to edit"), "old": ("string", "exact text to replace"),
           "new": ("string", "replacement text")}, ("path", "old", "new")),
    _tool("run_command", "Run a shell command in the repository and show its output.",
          {"command": ("string", "the command line"),
           "timeout_s": ("integer", "seconds before it is stopped")}, ("command",)),
    _tool("run_tests", "Run the test suite or the tests matching a pattern.",
          {"pattern": ("string", "test name pattern; all tests if omitted")}, ()),
    _tool("git_diff", "Show the uncommitted changes, or those of one path.",
          {"path": ("string", "limit the diff to this path")}, ()),
)

_AGENT_INTRO = (
    "You are a coding agent working in a software repository. Use the tools to look at files "
    "before you answer, make small careful changes, and say what you changed and why. "
    "Call one tool at a time. The tools:"
)
_CHAT_INTRO = "You are a helpful assistant. Answer briefly and precisely. Project notes:"

_TASKS = (
    "Find where `{ident}` is defined and explain what it does.",
    "Why does {path} fail when the {word} is empty? Fix it.",
    "Add a test for `{ident}` in {path}.",
    "Rename `{ident}` to `{ident2}` everywhere.",
    "Explain how {word} and {word2} interact in {path}.",
    "The {word} option is ignored by `{ident}`. Find out why and fix it.",
)
_FOLLOW_UPS = (
    "Also check {path}.",
    "Good. Now handle `{ident}` the same way.",
    "That broke the {word} case; look again.",
    "Keep going, but leave {path} alone.",
)
_QUESTIONS = (
    "What does {word} mean in {path}?",
    "Can you explain {word} and {word2} in simpler terms?",
    "Give me an example of {word}.",
    "How is that different from {word}?",
    "Thanks. And what about {word2}?",
)


def tool_schemas(count: int) -> list[dict[str, Any]]:
    """The first `count` tool schemas (at least the three whose results are generated)."""
    if not 3 <= count <= len(TOOL_SCHEMAS):
        raise ValueError(f"tool count must be 3 to {len(TOOL_SCHEMAS)}, not {count}")
    return [dict(t) for t in TOOL_SCHEMAS[:count]]


def system_prompt(corpus: Corpus, tools: list[dict[str, Any]] | None, target: int,
                  count: TokenCounter) -> str:
    """A system prompt of `target` tokens: intro, tool schemas, then project notes from prose.

    The same for every session of a workload (so a prefix cache can share it); it uses no
    randomness for that reason.
    """
    head = [_AGENT_INTRO if tools else _CHAT_INTRO]
    head += [json.dumps(t["function"], separators=(",", ":")) for t in tools or []]
    if tools:
        head.append("Project notes:")
    needed = count("\n".join(head))
    if needed > target:
        raise ValueError(f"system_tokens={target} is below the {needed} tokens of the intro "
                         f"and tool schemas; raise it or use fewer tools")
    return take_tokens(_then_prose(head, corpus), target, count)


def user_message(rng: np.random.Generator, corpus: Corpus, kind: str, target: int,
                 count: TokenCounter) -> str:
    """A user message of `target` tokens: `kind` is "task", "follow_up" or "question"."""
    templates = {"task": _TASKS, "follow_up": _FOLLOW_UPS, "question": _QUESTIONS}[kind]
    template = templates[int(rng.integers(len(templates)))]
    words = corpus.words
    idents = corpus.identifiers
    code = corpus.code
    text = template.format(
        word=words[int(rng.integers(len(words)))], word2=words[int(rng.integers(len(words)))],
        ident=idents[int(rng.integers(len(idents)))],
        ident2=idents[int(rng.integers(len(idents)))],
        path=code[int(rng.integers(len(code)))].path)
    return take_tokens(_then_quotes(text, rng, corpus), target, count)


def _then_prose(head: list[str], corpus: Corpus) -> Iterator[str]:
    yield from head
    while True:
        for f in corpus.prose:
            yield from (line for line in f.lines if line.strip())


def _then_quotes(text: str, rng: np.random.Generator, corpus: Corpus) -> Iterator[str]:
    yield text
    yield "Context:"
    while True:
        f = corpus.prose[int(rng.integers(len(corpus.prose)))]
        start = int(rng.integers(len(f.lines)))
        yield from (f"> {line}" for line in f.lines[start:start + 8] if line.strip())
