"""Anthropic's Messages API (`/v1/messages`), served by vLLM's own route on each engine.

vLLM renders a Messages request as a chat request of its own making and returns no token IDs
on this route, whole or streamed (nor a route that renders its prompt alone, but with
`--enable-scale-out`): a Messages turn gives its session no token history. The modes then plan
as for a turn the router does not tokenize (`affinity`): each engine's prefix cache finds the
history by itself, the decode engine keeps the session's lease, and turnkv has nothing to push
back (the prefill engine computes the last reply again with the next turn's new tokens).

Usage is Anthropic's: `input_tokens` are what was neither read from nor written to the cache,
`cache_read_input_tokens` what was read. The router makes the latter what the turn did not
compute (`chat.correct_usage` says why), moving the rest into `input_tokens`, so that their
sum stays the prompt. Errors are Anthropic's shape (`router.errors`), a stream's error event
too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from fastapi.responses import Response

from turnkv import protocol as p
from turnkv_server.router.apis.base import (
    Answer,
    Api,
    EventRelay,
    Relay,
    Seen,
    SseEvent,
    corrected_cached,
)
from turnkv_server.router.conversations import RelayedReply
from turnkv_server.router.errors import error_body, error_response

if TYPE_CHECKING:
    from turnkv_server.router.modes.base import Turn, TurnPlan

class Messages(Api):
    path = "/v1/messages"
    gives_token_ids = False
    key_header = "x-api-key"  # Anthropic's clients send their key there

    def prefill_request(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        prefill = dict(body)
        prefill.update(max_tokens=1, stream=False, kv_transfer_params=params)
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            # vLLM refuses a thinking budget not under max_tokens (but for its own P/D's
            # prefill). A budget only bounds sampling, never the prompt: "adaptive" renders
            # the same prompt without one.
            prefill["thinking"] = {"type": "adaptive"}
        return prefill

    def decode_request(self, body: dict[str, Any], params: dict[str, Any] | None,
                       token_ids: bool) -> dict[str, Any]:
        return {**body, "kv_transfer_params": params}

    def prefill_answer(self, data: dict[str, Any]) -> dict[str, Any]:
        return {"usage": chat_usage(data.get("usage")),
                "kv_transfer_params": data.get("kv_transfer_params")}

    def read_whole(self, data: dict[str, Any]) -> Answer:
        return Answer(usage=chat_usage(data.get("usage")), reply=data.get("kv_transfer_params"))

    def write_whole(self, data: dict[str, Any], turn: Turn, plan: TurnPlan,
                    stats: p.RouterTurnStats) -> None:
        data.pop("kv_transfer_params", None)  # (vLLM leaves out what is None)
        correct_usage(data.get("usage"), plan, stats)
        data["turnkv"] = stats.model_dump()

    def relay(self, turn: Turn, plan: TurnPlan, stats: p.RouterTurnStats) -> Relay:
        return MessagesRelay(turn, plan, stats)

    def reply(self, data: dict[str, Any]) -> RelayedReply:
        return RelayedReply.of_anthropic(data)

    def rejected(self, status: int, content: bytes) -> Response:
        """vLLM answers a request its models refuse in OpenAI's shape on every route (its
        validation handler is the whole app's), and only its Messages route's own errors in
        Anthropic's: the message goes to the client in Anthropic's shape either way."""
        try:
            body = orjson.loads(content)
        except ValueError:
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(body, dict) and body.get("type") == "error" and isinstance(error, dict):
            return super().rejected(status, content)
        message = error.get("message") if isinstance(error, dict) else None
        return error_response(status, str(message or "the engine refused the request"),
                              path=self.path)


MESSAGES = Messages()


class MessagesRelay(EventRelay):
    """vLLM's stream as it comes, but for the usage of `message_start` and `message_delta`
    (corrected), and `message_delta`, the last with usage, which gets the turn's stats as a
    `turnkv` field: no event is added."""

    def __init__(self, turn: Turn, plan: TurnPlan, stats: p.RouterTurnStats) -> None:
        super().__init__()
        self._plan, self._stats = plan, stats
        if turn.session_source == "inferred":
            self.message = RelayedReply()  # what the conversation goes on with

    def read_object(self, data: dict[str, Any]) -> Seen:
        kind = data.get("type")
        if self.message is not None:
            self.message.feed_anthropic(data)
        usage = data.get("usage")
        if kind == "message_start" and isinstance(data.get("message"), dict):
            usage = data["message"].get("usage")
        if isinstance(usage, dict):
            self._data = data
            correct_usage(usage, self._plan, self._stats)
            if kind == "message_delta":
                self._last = True
                self.answer = Answer(usage=chat_usage(usage))
        return Seen(output=kind == "content_block_delta", last=self._last)

    def rewrite(self, data: dict[str, Any], stats: p.RouterTurnStats) -> None:
        if self._last:
            data["turnkv"] = stats.model_dump()

    def error(self, message: str) -> bytes:
        return SseEvent(b"error", orjson.dumps(error_body(503, message, path=Messages.path))
                        ).encode()


def chat_usage(usage: Any) -> dict[str, Any]:
    """An Anthropic usage as chat's (what `router.stats` reads): the prompt is its input,
    cache-read and cache-written tokens together."""
    if not isinstance(usage, dict):
        return {}
    read = usage.get("cache_read_input_tokens")
    prompt = sum(int(usage.get(key) or 0) for key in
                 ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    return {"prompt_tokens": prompt, "completion_tokens": int(usage.get("output_tokens") or 0),
            "prompt_tokens_details": None if read is None else {"cached_tokens": int(read)}}


def correct_usage(usage: Any, plan: TurnPlan, stats: p.RouterTurnStats) -> None:
    """`cache_read_input_tokens` (in place): what the turn did not compute; `input_tokens` the
    rest of what was not written to the cache."""
    if not isinstance(usage, dict):
        return
    read = usage.get("cache_read_input_tokens")
    cached = corrected_cached(plan, stats, read)
    if cached is None or read is None:
        return
    usage["input_tokens"] = max(0, int(usage.get("input_tokens") or 0) + int(read) - cached)
    usage["cache_read_input_tokens"] = cached
