"""OpenAI's Chat Completions and Completions APIs (`/v1/chat/completions`, `/v1/completions`):
the engines return token IDs on both (`return_token_ids`), and the turn's stats go in a
`turnkv` field of a whole answer; in a streamed one, on the usage chunk where the client asked
for usage, else as a last chunk where it asked for the stats (`Turn.stats_in_stream`), else
nowhere but the headers (a stock client reads `choices[0]` of every chunk)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from turnkv import protocol as p
from turnkv_server.engine.requests import decode_request, prefill_request, tokenize_request
from turnkv_server.router.apis.base import Answer, Api, Relay, Seen, SseEvent
from turnkv_server.router.conversations import RelayedReply

if TYPE_CHECKING:
    from turnkv_server.router.modes.base import Turn, TurnPlan


# The routes whose streams take `stream_options.include_usage` (vLLM's and OpenAI's).
USAGE_PATHS = ("/v1/chat/completions", "/v1/completions")


def ask_usage(path: str, body: dict[str, Any]) -> bool:
    """Whether the client of a streamed turn asked for usage; asks the engine for it anyway
    (in `body`, on the routes that take `stream_options`): the stats count the turn's tokens
    and take the engine's timing from its usage chunk."""
    options = body.get("stream_options")
    asked = isinstance(options, dict) and bool(options.get("include_usage"))
    if path in USAGE_PATHS and (options is None or isinstance(options, dict)):
        body["stream_options"] = {**(options or {}), "include_usage": True}
    return asked


def strip_token_ids(data: dict[str, Any]) -> None:
    data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or []:
        choice.pop("token_ids", None)


def has_output(chunk: dict[str, Any]) -> bool:
    return any(choice.get("text") or choice.get("token_ids") or any(
        (choice.get("delta") or {}).get(key) for key in ("content", "tool_calls", "reasoning"))
        for choice in chunk.get("choices") or [])


def correct_usage(usage: dict[str, Any], plan: TurnPlan, stats: p.RouterTurnStats) -> None:
    """Make the decode engine's `usage.prompt_tokens_details.cached_tokens` (in place) what this
    turn did not compute: the turn's `reused_tokens`, as the SDK counts them.

    vLLM counts what a decode engine received over KV transfer as cached, so in P/D its
    figure includes the tokens the prefill engine has just computed for this very turn (a
    first turn that reused nothing showed 36). Stock openai and LangChain users read that
    field: the router returns the prefill side's reuse instead. A decode engine serving a
    short delta alone reports its own prefix hits, which are right as they are. A usage
    without `prompt_tokens_details` (an engine without `--enable-prompt-tokens-details`) is
    left without it rather than given a figure the engines did not report.
    """
    details = usage.get("prompt_tokens_details")
    if plan.alone is not None or not isinstance(details, dict) \
            or details.get("cached_tokens") is None:
        return
    reused = stats.prompt_tokens.prefill_reused
    if reused is not None:
        details["cached_tokens"] = reused


def stats_chunk(turn: Turn, stats: p.RouterTurnStats, template: dict[str, Any] | None) -> bytes:
    """The stats as a streamed turn's last chunk, shaped like the stream's own."""
    template = template or {}
    return sse({
        "id": template.get("id", turn.request_id),
        "object": template.get("object", "chat.completion.chunk"),
        "created": template.get("created", int(time.time())),
        "model": template.get("model", turn.body.get("model")),
        "choices": [],
        "turnkv": stats.model_dump(),
    })


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


class Chat(Api):
    def __init__(self, path: str) -> None:
        self.path = path

    def wants_token_ids(self, body: dict[str, Any]) -> bool:
        return bool(body.get("return_token_ids"))

    def prefill_request(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        return prefill_request(body, params)

    def decode_request(self, body: dict[str, Any], params: dict[str, Any] | None,
                       token_ids: bool) -> dict[str, Any]:
        return decode_request(body, params, token_ids)

    def tokenize_request(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return tokenize_request(body)

    def prefill_answer(self, data: dict[str, Any]) -> dict[str, Any]:
        return data

    def read_whole(self, data: dict[str, Any]) -> Answer:
        choices = data.get("choices") or [{}]
        return Answer(output_token_ids=list(choices[0].get("token_ids") or []),
                      usage=data.get("usage") or {}, reply=data.get("kv_transfer_params"),
                      metrics=data.get("metrics"))

    def write_whole(self, data: dict[str, Any], turn: Turn, plan: TurnPlan,
                    stats: p.RouterTurnStats) -> None:
        data.pop("kv_transfer_params", None)
        correct_usage(data.get("usage") or {}, plan, stats)
        if not turn.want_token_ids:
            strip_token_ids(data)
        data["turnkv"] = stats.model_dump()

    def relay(self, turn: Turn, plan: TurnPlan, stats: p.RouterTurnStats) -> Relay:
        return ChatRelay(turn, plan, stats)

    def engine_request_id(self, request_id: str) -> str:
        prefix = "chatcmpl" if self.path.endswith("/chat/completions") else "cmpl"
        return f"{prefix}-{request_id}"


CHAT = Chat("/v1/chat/completions")
COMPLETIONS = Chat("/v1/completions")


class ChatRelay(Relay):
    """Chunks as vLLM streams them; at `[DONE]`, the engine's usage chunk (the router always
    asks for it) with the turn's stats where the client asked for usage, else a stats chunk
    where it asked for the stats."""

    def __init__(self, turn: Turn, plan: TurnPlan, stats: p.RouterTurnStats) -> None:
        super().__init__()
        self._turn, self._plan, self._stats = turn, plan, stats
        self._template: dict[str, Any] | None = None
        self._event: SseEvent | None = None
        self._chunk: dict[str, Any] | None = None
        self._usage_chunk: dict[str, Any] | None = None  # the engine's, held for the stats
        self._done = False
        if turn.session_source == "inferred":
            self.message = RelayedReply()  # what the conversation goes on with

    def read(self, event: SseEvent) -> Seen:
        self._event, self._chunk = event, None
        if event.data == b"[DONE]":
            self._done = True
            return Seen(last=True)
        try:
            chunk = orjson.loads(event.data)
        except ValueError:
            return Seen()
        if not isinstance(chunk, dict):
            return Seen()
        self._chunk = chunk
        self._template = self._template or chunk
        for choice in chunk.get("choices") or []:
            self._turn.output_token_ids.extend(choice.get("token_ids") or [])
        if self.message is not None:
            self.message.feed(chunk)
        if chunk.get("usage"):
            self.answer.usage = chunk["usage"]
            self.answer.metrics = chunk.get("metrics")
            # (A P/D turn's reuse is known since its prefill.)
            correct_usage(chunk["usage"], self._plan, self._stats)
        return Seen(output=has_output(chunk))

    def write(self, stats: p.RouterTurnStats) -> list[bytes]:
        if self._done:
            out = []
            if self._usage_chunk is not None and self._turn.usage_in_stream:
                # One last chunk with no choices, as vLLM's own: its usage and the stats
                # together.
                self._usage_chunk["turnkv"] = stats.model_dump()
                out.append(sse(self._usage_chunk))
            elif self._turn.stats_in_stream:
                out.append(stats_chunk(self._turn, stats, self._template))
            return [*out, b"data: [DONE]\n\n"]
        chunk = self._chunk
        if chunk is None:
            assert self._event is not None
            return [b"data: " + self._event.data + b"\n\n"]
        if not self._turn.want_token_ids:
            strip_token_ids(chunk)
            if not chunk.get("choices") and not chunk.get("usage") and "error" not in chunk:
                return []
        if chunk.get("usage") and not chunk.get("choices") and "error" not in chunk:
            self._usage_chunk = chunk  # sent, if asked for, with the stats at the end
            return []
        return [sse(chunk)]

    def error(self, message: str) -> bytes:
        return sse({"error": {"message": message, "type": "service_unavailable",
                                         "code": 503}})
