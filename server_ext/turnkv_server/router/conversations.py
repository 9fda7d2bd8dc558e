"""A chat conversation as digests, for recognising a conversation nobody tagged
(`inferred_sessions`): the canonical form of its messages, chained.

The digest of a conversation's first n messages is that of its first n-1 and the n-th
message's canonical form, all under a seed: the tenant, the model and what renders the
conversation besides its messages (`tools`, `chat_template`, `chat_template_kwargs`, the
client's `cache_salt`). So two requests share a digest at message n exactly when they agree
on everything up to there, and a digest never matches across tenants.

Canonical form: what decides the prompt's tokens and survives a client's round trip. A client
sends the assistant's reply back as the next turn's history, and clients differ in how: with
`content` `null` or `""` beside tool calls, content parts or a string, `refusal`, `audio` and
`annotations` as `null`, reasoning dropped, tool-call IDs kept or made anew, arguments
re-serialised. So a message is its role, its text (parts' texts joined, any other part as its
JSON), trimmed, its tool calls as name and arguments (JSON arguments re-serialised with sorted
keys), and for a tool result its `tool_call_id`; reasoning and the rest are left out. Two
messages that differ only in what is left out are taken for one: the router's check of the
token history stays the last line of defence, and reuse stops where the tokens differ.

The Responses and Messages APIs' conversations are read as chat's (`chat_messages`): a
Responses request's `instructions` and a Messages request's `system` as a system message
first; Responses items as messages (an assistant message and the function calls after it as
one assistant message with tool calls, a `function_call_output` as a tool message, reasoning
left out); Anthropic content blocks as text, `tool_use` blocks as tool calls, thinking left out
and `cache_control` (which Claude Code moves to the newest message every turn) ignored.

The reply as the router relayed it (`RelayedReply`: a whole answer's, or gathered from a stream) is
canonicalised the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

DIGEST_BYTES = 16
# What renders a conversation besides its messages: two requests that differ in any of it are
# not one conversation's turns.
_RENDERING = ("model", "tools", "chat_template", "chat_template_kwargs", "cache_salt")
# The routes whose requests are conversations (a completion's prompt is one string: no turns).
CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
CONVERSATION_PATHS = (CHAT_PATH, RESPONSES_PATH, MESSAGES_PATH)


@dataclass(frozen=True)
class PromptDigests:
    """A chat request's digests: its whole prompt's, and at each assistant message (the
    conversation boundaries a previous turn's reply closed), the last first."""

    prompt: bytes
    boundaries: tuple[bytes, ...]


def prompt_digests(body: dict[str, Any], tenant: str, path: str = CHAT_PATH
                   ) -> PromptDigests | None:
    """The digests of a request on one of the `CONVERSATION_PATHS`; None for anything else (a
    completion's prompt, malformed messages: the engine answers those)."""
    messages = chat_messages(path, body)
    if not messages:
        return None
    digest = _seed(body, tenant)
    boundaries = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        digest = chain(digest, canonical(message))
        if message.get("role") == "assistant":
            boundaries.append(digest)
    return PromptDigests(digest, tuple(reversed(boundaries)))


def chat_messages(path: str, body: dict[str, Any]) -> list[Any] | None:
    """A request's conversation as chat messages (not checked further: `prompt_digests` reads
    what it can); None where the route has none or the request is malformed."""
    if path == CHAT_PATH:
        messages = body.get("messages")
        return messages if isinstance(messages, list) else None
    if path == RESPONSES_PATH:
        return _responses_messages(body)
    if path == MESSAGES_PATH:
        return _anthropic_messages(body)
    return None


def chain(digest: bytes, message: bytes) -> bytes:
    return hashlib.blake2b(digest + message, digest_size=DIGEST_BYTES).digest()


def canonical(message: dict[str, Any]) -> bytes:
    """A message as the digests see it."""
    role = message.get("role")
    listed = message.get("tool_calls")
    calls = [_call(c) for c in listed if isinstance(c, dict)] if isinstance(listed, list) else []
    form: list[Any] = [role, _text(message.get("content")), calls]
    if role == "tool":
        form.append(message.get("tool_call_id"))
    elif role != "assistant":
        form.append(message.get("name"))  # names a participant; clients echo none on replies
    return _json(form).encode()


@dataclass
class RelayedReply:
    """The assistant message a turn answered, as relayed: a whole response's, or gathered
    from a stream's deltas (`feed`)."""

    text: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    seen: bool = False  # a choice came: a reply, even an empty one

    @classmethod
    def of_response(cls, data: dict[str, Any]) -> RelayedReply:
        reply = cls()
        choices = data.get("choices") or []
        message = choices[0].get("message") if choices and isinstance(choices[0], dict) \
            else None
        if isinstance(message, dict):
            reply.seen = True
            reply.text.append(message.get("content") or "")
            for index, call in enumerate(message.get("tool_calls") or []):
                if isinstance(call, dict):
                    reply.calls[index] = call
        return reply

    def feed(self, chunk: dict[str, Any]) -> None:
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            self.seen = True
            delta = choice.get("delta") or {}
            self.text.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                slot = self.calls.setdefault(int(call.get("index", 0)), {
                    "function": {"name": "", "arguments": ""}})
                function = call.get("function") or {}
                slot["function"]["name"] += function.get("name") or ""
                slot["function"]["arguments"] += function.get("arguments") or ""

    @classmethod
    def of_responses(cls, response: dict[str, Any]) -> RelayedReply:
        """A Responses answer's output items (a whole answer, or a stream's last event's)."""
        reply = cls()
        output = response.get("output")
        reply.seen = isinstance(output, list)
        for item in output if isinstance(output, list) else []:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "function_call":
                reply.calls[len(reply.calls)] = _function(item.get("name"),
                                                          item.get("arguments"))
            elif item.get("type") == "message" and item.get("role") == "assistant":
                reply.text.append(_parts_text(item.get("content")))
        return reply

    @classmethod
    def of_anthropic(cls, message: dict[str, Any]) -> RelayedReply:
        """A whole Messages answer's content blocks; a stream's are `feed_anthropic`'s."""
        reply = cls()
        content = message.get("content")
        reply.seen = isinstance(content, list)
        reply.text.append(_assistant_text(content, reply.calls))
        return reply

    def feed_anthropic(self, event: dict[str, Any]) -> None:
        """One event of a Messages stream: its content blocks' text and tool calls."""
        kind, index = event.get("type"), event.get("index")
        if kind == "message_start":
            self.seen = True
        elif kind == "content_block_start" and isinstance(index, int):
            block = event.get("content_block") or {}
            if block.get("type") == "text":
                self.text.append(str(block.get("text") or ""))
            elif block.get("type") == "tool_use":
                self.calls[index] = _function(block.get("name"), "")
        elif kind == "content_block_delta" and isinstance(index, int):
            delta = event.get("delta") or {}
            if delta.get("type") == "text_delta":
                self.text.append(str(delta.get("text") or ""))
            elif delta.get("type") == "input_json_delta" and index in self.calls:
                self.calls[index]["function"]["arguments"] += delta.get("partial_json") or ""
        elif kind == "content_block_stop" and index in self.calls:
            # A tool called without arguments streams none: the client keeps `input: {}`.
            function = self.calls[index]["function"]
            function["arguments"] = function["arguments"] or "{}"

    def message(self) -> dict[str, Any] | None:
        """The reply as a client sends it back; None when no choice came."""
        if not self.seen:
            return None
        return {"role": "assistant", "content": "".join(self.text),
                "tool_calls": [self.calls[i] for i in sorted(self.calls)]}


def _seed(body: dict[str, Any], tenant: str) -> bytes:
    rendering = [tenant, *(_uncached(body.get(name)) for name in _RENDERING)]
    return hashlib.blake2b(_json(rendering).encode(), digest_size=DIGEST_BYTES).digest()


def _json(value: Any) -> str:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # an integer beyond 64 bits: the engine refuses the request anyway
        return repr(value)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text") or ""))
            else:
                parts.append(_json(part))
        return "".join(parts).strip()
    return str(content)


def _call(call: dict[str, Any]) -> list[Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        return [function]  # malformed: the engine refuses it; kept as it is
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except ValueError:
            return [function.get("name"), arguments.strip()]
    return [function.get("name"), _json(arguments)]


def _responses_messages(body: dict[str, Any]) -> list[Any] | None:
    """A Responses request's `instructions` and `input` items as chat messages."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": _parts_text(body["instructions"])})
    for item in items:
        if not isinstance(item, dict):
            return None
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            continue
        if kind == "function_call" or (kind == "message" and item.get("role") == "assistant"):
            # A reply's output items, however many, are one assistant message (`RelayedReply`).
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": "", "tool_calls": []})
            if kind == "function_call":
                messages[-1]["tool_calls"].append(_function(item.get("name"),
                                                            item.get("arguments")))
            else:
                messages[-1]["content"] += _parts_text(item.get("content"))
        elif kind == "message":
            messages.append({"role": item.get("role"),
                             "content": _parts_text(item.get("content"))})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _parts_text(item.get("output"))})
        else:
            messages.append({"role": kind, "content": _json(
                {k: v for k, v in item.items() if k not in ("id", "status")})})
    return messages


def _anthropic_messages(body: dict[str, Any]) -> list[Any] | None:
    """A Messages request's `system` and `messages` as chat messages."""
    listed = body.get("messages")
    if not isinstance(listed, list):
        return None
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _blocks_text(body["system"])})
    for message in listed:
        if not isinstance(message, dict):
            return None
        if message.get("role") == "assistant":
            calls: dict[int, dict[str, Any]] = {}
            text = _assistant_text(message.get("content"), calls)
            messages.append({"role": "assistant", "content": text,
                             "tool_calls": [calls[i] for i in sorted(calls)]})
        else:
            messages.append({"role": message.get("role"),
                             "content": _blocks_text(message.get("content"))})
    return messages


def _function(name: Any, arguments: Any) -> dict[str, Any]:
    return {"function": {"name": name, "arguments": arguments}}


def _parts_text(content: Any) -> str:
    """Responses content: a string, or parts (`input_text`, `output_text`: their text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") if isinstance(part, dict)
                       and part.get("type") in ("input_text", "output_text", "text")
                       else _json(part) for part in content)
    return _json(content)


def _blocks_text(content: Any) -> str:
    """Anthropic content of a user or system turn: a string, or blocks (text blocks' text,
    any other block as its JSON, `cache_control` aside)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(block.get("text") or "") if isinstance(block, dict)
                       and block.get("type") == "text" else _json(_uncached(block))
                       for block in content)
    return _json(content)


def _assistant_text(content: Any, calls: dict[int, dict[str, Any]]) -> str:
    """An Anthropic assistant turn's text blocks' text; its `tool_use` blocks go in `calls`.
    Thinking and other blocks are left out, as reasoning is."""
    if isinstance(content, str):
        return content
    text = []
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "text":
            text.append(str(block.get("text") or ""))
        elif block.get("type") == "tool_use":
            calls[len(calls)] = _function(block.get("name"), block.get("input"))
    return "".join(text)


def _uncached(value: Any) -> Any:
    """`value` without Anthropic's `cache_control` markers, at any depth."""
    if isinstance(value, dict):
        return {k: _uncached(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_uncached(v) for v in value]
    return value
