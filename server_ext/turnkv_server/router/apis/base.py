"""What the turn pipeline (`router.turn`) needs to know of the API a turn came in on: one small
description per API (`Api`), so that every API goes through the same pipeline, modes and stats.

The engines serve each API natively (vLLM 0.32 takes `kv_transfer_params` on all of them), so
an answer is the one a single engine gives to the same request. What differs between APIs is
only how a request is read and written:

- how the prefill request is written (one token, whole, asking for the prompt's token IDs
  where the route can give them) and the decode request (asking for token IDs likewise);
- how the prompt is rendered alone for the modes that tokenize first (`/tokenize` speaks chat
  only: other APIs have none, and the modes plan without);
- where an answer keeps its usage, token IDs and `kv_transfer_params` (`Answer`, read into the
  chat-shaped usage `router.stats` reads), and where the router writes its corrections and the
  turn's stats back, whole or streamed (`Relay`, one streamed answer event by event);
- the shape of its errors (`router.errors`).

`Api` instances may carry one turn's own context (the Responses API's state): where an API
keeps what it answered (`keeps_answers`), `answered` is called with the client's whole answer
once the turn is served.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from fastapi.responses import JSONResponse, Response

from turnkv import protocol as p
from turnkv_server.router.conversations import RelayedReply
from turnkv_server.router.engines import SseEvent
from turnkv_server.router.errors import error_response

if TYPE_CHECKING:
    from turnkv_server.router.modes.base import Turn, TurnPlan

__all__ = ["Answer", "Api", "EventRelay", "Prepared", "Relay", "Resolve", "Resolved", "Seen",
           "SseEvent"]


@dataclass
class Answer:
    """What a decode engine's answer says about the turn, in the router's terms: usage is
    chat-shaped (`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`),
    whatever the API's own shape."""

    output_token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    # The decode engine's kv_transfer_params, where the answer carries them.
    reply: dict[str, Any] | None = None
    # vLLM's per-request timing.
    metrics: Any = None


@dataclass(frozen=True)
class Seen:
    """What one streamed event was: whether it carries model output (the first such event
    times the first token), and whether it is the one the turn's stats go with (the answer is
    whole once it has been read: its usage is in)."""

    output: bool = False
    last: bool = False


@dataclass(eq=False)
class Relay(ABC):
    """One streamed answer, read event by event (`read`), each then written for the client
    (`write`). The pipeline finishes the turn's stats between the two for the `last` event."""

    answer: Answer = field(default_factory=Answer)
    # The client's whole answer, where the API's stream ends with one (the Responses API's
    # `response.completed`): what `Api.answered` gets.
    whole: dict[str, Any] | None = None
    # The assistant message relayed, gathered for a session inferred from its conversation
    # (`inferred_sessions`); None where nothing gathers it.
    message: RelayedReply | None = None

    @abstractmethod
    def read(self, event: SseEvent) -> Seen:
        """Take in one event of the decode engine's stream."""

    @abstractmethod
    def write(self, stats: p.RouterTurnStats) -> list[bytes]:
        """What the event just read becomes for the client (none, one, or more events);
        `stats` are final when it was the `last`."""

    @abstractmethod
    def error(self, message: str) -> bytes:
        """An error event in the stream's own shape: the decode engine was lost mid-answer."""


class EventRelay(Relay):
    """A stream of named events, each one JSON object (the Messages and Responses APIs). Of
    every object it reads (`read_object`) a relay keeps those it changes (`_data`) and writes
    them again (`rewrite`); every other event goes on as it came, to the byte."""

    def __init__(self) -> None:
        super().__init__()
        self._event: SseEvent | None = None
        self._data: dict[str, Any] | None = None  # the event's object, kept to be rewritten
        self._last = False  # the event the turn's stats go with

    def read(self, event: SseEvent) -> Seen:
        self._event, self._data, self._last = event, None, False
        try:
            data = orjson.loads(event.data)
        except ValueError:
            return Seen()
        if not isinstance(data, dict):
            return Seen()
        return self.read_object(data)

    def write(self, stats: p.RouterTurnStats) -> list[bytes]:
        assert self._event is not None
        if self._data is None:
            return [self._event.encode()]
        self.rewrite(self._data, stats)
        return [SseEvent(self._event.name, orjson.dumps(self._data)).encode()]

    @abstractmethod
    def read_object(self, data: dict[str, Any]) -> Seen:
        """`read` for an event whose data is a JSON object; sets `_data` to keep it."""

    @abstractmethod
    def rewrite(self, data: dict[str, Any], stats: p.RouterTurnStats) -> None:
        """The kept object (in place) as the client gets it; `stats` are final for `_last`."""


class Api(ABC):
    """An API the router serves, as the turn pipeline needs to know it."""

    # The engines' route for it.
    path: str
    # The header its clients may send the API key in instead of `Authorization: Bearer`
    # (`Tenants.tenant_of`); None: that one only.
    key_header: str | None = None
    # Whether the engines report a turn's prompt and output token IDs on this route: without
    # them the session keeps no token history (the modes plan as they do for `affinity`).
    gives_token_ids: bool = True
    # Whether the API keeps the answers it gave (the Responses API's state): only then does
    # the pipeline tell it a turn was answered (`answered`).
    keeps_answers: bool = False

    def wants_token_ids(self, body: dict[str, Any]) -> bool:
        """The client itself asked for token IDs (the router otherwise strips them)."""
        return False

    @abstractmethod
    def prefill_request(self, body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        """The client's request as a one-token, whole prefill carrying `params`, asking for
        the prompt's token IDs where the route gives them."""

    @abstractmethod
    def decode_request(self, body: dict[str, Any], params: dict[str, Any] | None,
                       token_ids: bool) -> dict[str, Any]:
        """The client's request with the decode engine's params, asking for token IDs when
        `token_ids` (the router keeps the session's history) and the route gives them."""

    def tokenize_request(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The engines' `/tokenize` request that renders `body`'s prompt alone; None where the
        API has none."""
        return None

    @abstractmethod
    def prefill_answer(self, data: dict[str, Any]) -> dict[str, Any]:
        """The prefill engine's answer as a chat answer's fields `stats.PrefillResult` reads
        (`usage`, `prompt_token_ids`, `kv_transfer_params`, `metrics`)."""

    @abstractmethod
    def read_whole(self, data: dict[str, Any]) -> Answer:
        """What a whole (non-streamed) answer says."""

    @abstractmethod
    def write_whole(self, data: dict[str, Any], turn: Turn, plan: TurnPlan,
                    stats: p.RouterTurnStats) -> None:
        """Make `data` (in place) the client's answer: usage corrected to what the turn did
        not compute, the router's fields off, the turn's stats in."""

    @abstractmethod
    def relay(self, turn: Turn, plan: TurnPlan, stats: p.RouterTurnStats) -> Relay:
        """A streamed answer's relay (`stats` hold the prefill's part already)."""

    def engine_request_id(self, request_id: str) -> str:
        """The ID the engines give the request the router sends with `X-Request-Id:
        request_id` (vLLM's NixlPushConnector pairs the two engines' requests by it)."""
        return f"chatcmpl-{request_id}"

    def reply(self, data: dict[str, Any]) -> RelayedReply:
        """A whole answer's assistant message, as the client sends it back next turn: what a
        session inferred from its conversation goes on with."""
        return RelayedReply.of_response(data)

    async def answered(self, whole: dict[str, Any] | None) -> None:
        """The turn was served: `whole` is the client's whole answer where there is one (called
        where the API `keeps_answers`)."""
        return None

    def rejected(self, status: int, content: bytes) -> Response:
        """An engine's refusal of the request (below 500), passed on: vLLM's errors are in the
        API's own shape but where an API says otherwise."""
        return Response(content, status, media_type="application/json")

    def error_response(self, status: int, message: str, *, kind: str | None = None,
                       param: str | None = None,
                       headers: dict[str, str] | None = None) -> JSONResponse:
        """An error in the API's shape (`router.errors`: Anthropic's on `/v1/messages`,
        else OpenAI's)."""
        return error_response(status, message, kind=kind, param=param, headers=headers,
                              path=self.path)


@dataclass
class Prepared:
    """A request made ready for the pipeline by its route: the API that serves it, the body the
    engines get (before each engine's own fields), its tag and prefix ID, and where a session
    it opens starts (the (prefill, decode) engines its state says hold its KV; prefill None:
    the decode engine alone)."""

    api: Api
    body: dict[str, Any]
    tag: p.TurnTag | None
    prefix_id: str | None
    home: tuple[str | None, str] | None = None


@dataclass
class Resolved:
    """What a route with state of its own (the Responses API's) resolved of a request before
    its keys are read (`app.read_keys`): the session its lineage names, which takes its place
    in the order of session keys, and how the request, once its keys are read (its body
    without them, its tag from whichever key named it, its prefix ID), becomes one turn of
    its API (`prepare`)."""

    lineage: str | None
    prepare: Callable[[dict[str, Any], p.TurnTag | None, str | None], Prepared]


# A route's step between reading a request (the body, the tenant) and reading its keys.
Resolve = Callable[[dict[str, Any], str], Awaitable[Resolved]]


def corrected_cached(plan: TurnPlan, stats: p.RouterTurnStats, cached: int | None) -> int | None:
    """The cached-token figure the client is told, given the decode engine's (`cached`): what
    the turn did not compute (`chat.correct_usage` says why); None: leave it as it is."""
    if plan.alone is not None or cached is None:
        return None
    return stats.prompt_tokens.prefill_reused
