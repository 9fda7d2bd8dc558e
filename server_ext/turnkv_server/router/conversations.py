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

The reply as the router relayed it (`RelayedReply`: a whole response's message, or a stream's
deltas) is canonicalised the same way.
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


@dataclass(frozen=True)
class PromptDigests:
    """A chat request's digests: its whole prompt's, and at each assistant message (the
    conversation boundaries a previous turn's reply closed), the last first."""

    prompt: bytes
    boundaries: tuple[bytes, ...]


def prompt_digests(body: dict[str, Any], tenant: str) -> PromptDigests | None:
    """The digests of a chat request (`messages`); None for anything else (a completion's
    prompt, malformed messages: the engine answers those)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
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

    def message(self) -> dict[str, Any] | None:
        """The reply as a client sends it back; None when no choice came."""
        if not self.seen:
            return None
        return {"role": "assistant", "content": "".join(self.text),
                "tool_calls": [self.calls[i] for i in sorted(self.calls)]}


def _seed(body: dict[str, Any], tenant: str) -> bytes:
    rendering = [tenant, *(body.get(name) for name in _RENDERING)]
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
