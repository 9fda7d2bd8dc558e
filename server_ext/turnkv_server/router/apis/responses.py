"""OpenAI's Responses API (`/v1/responses`), one turn's description: the engines get a stateless
request (`apis.responses_state` wrote it: the whole input, `store` off, the response's ID as
its `request_id`), and its answers are written back as the client's.

vLLM's Responses route returns no `prompt_token_ids`; with `enable_response_messages` it
returns the prompt's and the output's token IDs (`input_messages`, `output_messages`: the raw
prompt and its tokens, the raw output and its tokens), whole or in a stream's
`response.completed`. The router asks for them on every request and removes them from the
client's answer unless the client asked too. The answer's `kv_transfer_params` (a streamed
one's too, in `response.completed`) are the decode engine's reply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import orjson

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

if TYPE_CHECKING:
    from turnkv_server.router.modes.base import Turn, TurnPlan

# The stream events that end a response, with it whole.
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
# What the router adds to every engine request, and removes from answers the client did not
# ask for them in.
MESSAGES_FIELDS = ("input_messages", "output_messages")


class Keeper(Protocol):
    """Where a served response goes (`responses_state.ResponsesService`)."""

    async def answered(self, api: ResponsesApi, whole: dict[str, Any]) -> None: ...


class ResponsesApi(Api):
    """One Responses request: `response_id` names it (and the engines' request); `echo` is what
    the answer repeats of the client's own request where the engines saw another
    (`previous_response_id`)."""

    path = "/v1/responses"
    keeps_answers = True

    def __init__(self, response_id: str, echo: dict[str, Any], wants_messages: bool,
                 keeper: Keeper | None = None) -> None:
        self.response_id = response_id
        self.echo = echo
        self.wants_messages = wants_messages
        self.keeper = keeper

    def wants_token_ids(self, body: dict[str, Any]) -> bool:
        return self.wants_messages

    def prefill_request(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        prefill = {k: v for k, v in body.items() if k != "stream_options"}
        prefill.update(max_output_tokens=1, stream=False, enable_response_messages=True,
                       kv_transfer_params=params)
        return prefill

    def decode_request(self, body: dict[str, Any], params: dict[str, Any] | None,
                       token_ids: bool) -> dict[str, Any]:
        decode = dict(body)
        decode["kv_transfer_params"] = params
        if token_ids:
            decode["enable_response_messages"] = True
        return decode

    def prefill_answer(self, data: dict[str, Any]) -> dict[str, Any]:
        tokens = raw_tokens(data.get("input_messages"))
        return {"usage": chat_usage(data.get("usage")),
                "prompt_token_ids": tokens or None,
                "kv_transfer_params": data.get("kv_transfer_params"),
                "metrics": data.get("metrics")}

    def read_whole(self, data: dict[str, Any]) -> Answer:
        return Answer(output_token_ids=raw_tokens(data.get("output_messages")),
                      usage=chat_usage(data.get("usage")),
                      reply=data.get("kv_transfer_params"), metrics=data.get("metrics"))

    def write_whole(self, data: dict[str, Any], turn: Turn, plan: TurnPlan,
                    stats: p.RouterTurnStats) -> None:
        self.as_client_sees(data)
        correct_usage(data.get("usage"), plan, stats)
        data["turnkv"] = stats.model_dump()

    def relay(self, turn: Turn, plan: TurnPlan, stats: p.RouterTurnStats) -> Relay:
        return ResponsesRelay(self, turn, plan, stats)

    def reply(self, data: dict[str, Any]) -> RelayedReply:
        return RelayedReply.of_responses(data)

    def engine_request_id(self, request_id: str) -> str:
        return self.response_id  # the engines take the body's `request_id`, not the header

    async def answered(self, whole: dict[str, Any] | None) -> None:
        if whole is not None and self.keeper is not None:
            await self.keeper.answered(self, whole)

    def as_client_sees(self, response: dict[str, Any]) -> None:
        """A response object (in place) as the client would have it from an engine that kept
        its state itself: its own request's echo, no router fields."""
        response.update(self.echo)
        if "kv_transfer_params" in response:
            response["kv_transfer_params"] = None
        if not self.wants_messages:
            for key in MESSAGES_FIELDS:
                if key in response:
                    response[key] = None


class ResponsesRelay(EventRelay):
    """vLLM's stream as it comes (named events), but for the response objects it carries (the
    client's echo), and the last (`response.completed`), whose usage is corrected and which
    gets the turn's stats as the response's `turnkv` field: no event is added."""

    def __init__(self, api: ResponsesApi, turn: Turn, plan: TurnPlan, stats: p.RouterTurnStats
                 ) -> None:
        super().__init__()
        self._api, self._turn, self._plan, self._stats = api, turn, plan, stats
        self._sequence = 0

    def read_object(self, data: dict[str, Any]) -> Seen:
        kind = str(data.get("type") or "")
        if isinstance(data.get("sequence_number"), int):
            self._sequence = data["sequence_number"] + 1
        response = data.get("response")
        if isinstance(response, dict):
            self._data = data
            if kind in FINAL_EVENTS:
                self._last = True
                self.answer = self._api.read_whole(response)
                self._turn.output_token_ids = self.answer.output_token_ids
                if self._turn.session_source == "inferred":
                    self.message = RelayedReply.of_responses(response)
                correct_usage(response.get("usage"), self._plan, self._stats)
        return Seen(output=kind.endswith(".delta"), last=self._last)

    def rewrite(self, data: dict[str, Any], stats: p.RouterTurnStats) -> None:
        response = data["response"]
        self._api.as_client_sees(response)
        if self._last:
            response["turnkv"] = stats.model_dump()
            self.whole = response

    def error(self, message: str) -> bytes:
        return SseEvent(b"error", orjson.dumps({
            "type": "error", "code": "service_unavailable", "message": message, "param": None,
            "sequence_number": self._sequence})).encode()


# The API's errors before a request is read and made one turn's (OpenAI's shape).
RESPONSES_ERRORS = ResponsesApi(response_id="", echo={}, wants_messages=False)


def raw_tokens(messages: Any) -> list[int]:
    """The token IDs of vLLM's `input_messages` / `output_messages` (raw message entries)."""
    tokens: list[int] = []
    for entry in messages if isinstance(messages, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("tokens"), list):
            tokens.extend(int(t) for t in entry["tokens"])
    return tokens


def chat_usage(usage: Any) -> dict[str, Any]:
    """A Responses usage as chat's (what `router.stats` reads)."""
    if not isinstance(usage, dict):
        return {}
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {"prompt_tokens": int(usage.get("input_tokens") or 0),
            "completion_tokens": int(usage.get("output_tokens") or 0),
            "prompt_tokens_details": None if cached is None else {"cached_tokens": cached}}


def correct_usage(usage: Any, plan: TurnPlan, stats: p.RouterTurnStats) -> None:
    """`usage.input_tokens_details.cached_tokens` (in place): what the turn did not compute, as
    for chat (`chat.correct_usage`)."""
    details = usage.get("input_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict):
        return
    cached = corrected_cached(plan, stats, details.get("cached_tokens"))
    if cached is not None:
        details["cached_tokens"] = cached
