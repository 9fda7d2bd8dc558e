"""The Responses API's state, owned by the router: `previous_response_id`, `conversation` and
`store` resolve here, on any router (`responses_store`: Redis where routers share it), and the
engines get a stateless request with the whole input.

A stored response (`StoredResponse`) keeps the whole input its engines saw (the conversation
before it, instructions aside) and the response as its client got it: a continuation's input is
that input, that response's output items, then its own input, which is what an engine that kept
the state itself renders (vLLM prepends the stored messages and the previous output the same
way; OpenAI's `instructions` do not carry over, each request's own apply). Each record stands
alone: evicting or deleting one never breaks another chain, at the cost of storing a chain's
history once per response (the bytes bound counts it).

A chain of responses is one session (`lineage_session`): a continuation's lineage names the
session the response it continues was served in, and where that response was served in none
(a root no key named: nothing says it will be continued), its chain's root. So a chain is one
session, named by its root, or by the key that named its first turns' session (an
`X-Session-ID`, turnkv's tag) when later turns send only `previous_response_id`. The lineage
is one of the session keys, in their order (`app.read_keys`, docs/protocol.md): a key before
it in that order, sent with a continuation, names the session instead, and the chain goes on
in that one. The session a chain opens with its second response starts on the engines that
served the first (`StoredResponse.served_on`), where its KV is. A `conversation` names its
session itself, and the router keeps its items the same way. `store: false` with the whole
history every turn (Codex's way) keeps nothing here: its session comes from the other keys.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from turnkv import protocol as p
from turnkv_server.router.apis.base import Prepared, Resolved
from turnkv_server.router.apis.responses import ResponsesApi
from turnkv_server.router.errors import BadRequest
from turnkv_server.router.responses_store import ResponseStore, StoreUnavailable

log = logging.getLogger(__name__)

# The client's fields the engines never see: the router resolves them.
STATE_FIELDS = ("previous_response_id", "conversation", "store")


@dataclass(frozen=True)
class StoredResponse:
    response_id: str
    root: str  # the chain's first response
    input: list[Any]  # the whole input the engines saw, instructions aside
    response: dict[str, Any]  # as the client got it

    def session(self) -> str | None:
        """The session it was served in (its stats say), if any."""
        stats = self.response.get("turnkv")
        session = stats.get("session_id") if isinstance(stats, dict) else None
        return session if isinstance(session, str) and p.is_valid_id(session) else None

    def served_on(self) -> tuple[str | None, str] | None:
        """The (prefill, decode) engines that served it (prefill None: the decode engine
        computed the prompt alone; so always in `affinity`)."""
        stats = self.response.get("turnkv")
        if not isinstance(stats, dict) or not isinstance(stats.get("decode_node"), str):
            return None
        prefill = stats.get("prefill_node")
        return prefill if isinstance(prefill, str) else None, stats["decode_node"]

    def history(self) -> list[Any]:
        """What a continuation continues: the input, then this response's output items."""
        return [*self.input, *(self.response.get("output") or [])]

    def encode(self) -> bytes:
        return orjson.dumps({"kind": "response", "id": self.response_id, "root": self.root,
                             "input": self.input, "response": self.response})

    @classmethod
    def decode(cls, raw: bytes, response_id: str) -> StoredResponse | None:
        try:
            record = orjson.loads(raw)
        except ValueError:
            return None
        if not isinstance(record, dict) or record.get("kind") != "response" \
                or record.get("id") != response_id:
            return None
        return cls(response_id, str(record.get("root") or response_id),
                   list(record.get("input") or []), dict(record.get("response") or {}))


def lineage_session(body: Mapping[str, Any], previous: StoredResponse | None) -> str | None:
    """The session a Responses request continues by its lineage: the session the response its
    `previous_response_id` names (`previous`, resolved) was served in, or that response's
    chain's root where it was served in none; else its `conversation`; None for neither."""
    if previous is not None:
        return previous.session() or previous.root
    return conversation_id(body)


def conversation_id(body: Mapping[str, Any]) -> str | None:
    """`conversation`: an ID, or an object with one."""
    found = body.get("conversation")
    if isinstance(found, dict):
        found = found.get("id")
    if found is None:
        return None
    if not isinstance(found, str) or not p.is_valid_id(found):
        raise BadRequest("conversation must be an ID (1-128 characters of [A-Za-z0-9._:-]) or "
                         "an object with one", param="conversation")
    return found


def as_items(request_input: Any) -> list[Any]:
    """A request's `input` as a list of items (a string is one user message)."""
    if isinstance(request_input, str):
        return [{"role": "user", "content": request_input}]
    if isinstance(request_input, list):
        return list(request_input)
    raise BadRequest("input must be a string or a list of items", param="input")


def stateless(body: dict[str, Any], history: list[Any] | None, response_id: str
              ) -> dict[str, Any]:
    """The engines' request: the history first (a request that continues none keeps its input
    as it came), nothing stored there, the response named `response_id`."""
    engine = {k: v for k, v in body.items() if k not in STATE_FIELDS}
    if history is not None:
        engine["input"] = [*history, *as_items(body.get("input"))]
    engine["store"] = False
    engine["request_id"] = response_id
    return engine


class ResponsesService:
    """The Responses API's state on one router."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def resolve(self, body: dict[str, Any], tenant: str) -> Resolved:
        """A Responses request's state, resolved before its keys are read: the history it
        continues and the session its lineage names; then (`Resolved.prepare`, once the keys
        are read) the request made one turn's."""
        _check(body)
        previous = await self._previous(body, tenant)
        conversation = conversation_id(body)
        if previous is not None and conversation is not None:
            raise BadRequest("previous_response_id and conversation cannot both be set",
                             param="conversation")
        history = previous.history() if previous is not None else None
        if conversation is not None:
            history = await self._conversation(tenant, conversation)

        def prepare(body: dict[str, Any], tag: p.TurnTag | None, prefix_id: str | None
                    ) -> Prepared:
            response_id = f"resp_{uuid.uuid4().hex}"
            engine = stateless(body, history, response_id)
            api = ResponsesApi(response_id,
                               echo={"previous_response_id": body.get("previous_response_id")},
                               wants_messages=bool(body.get("enable_response_messages")),
                               keeper=_Keeper(self, tenant, body, previous, conversation,
                                              as_items(engine["input"])))
            # A session the chain opens now (with its second response) starts where the
            # previous response was served, its KV there.
            home = previous.served_on() if previous is not None else None
            return Prepared(api, engine, tag, prefix_id, home)

        return Resolved(lineage_session(body, previous), prepare)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        raw = await self.store.get(tenant, response_id)
        return None if raw is None else StoredResponse.decode(raw, response_id)

    async def delete(self, tenant: str, response_id: str) -> bool:
        return await self.get(tenant, response_id) is not None \
            and await self.store.delete(tenant, response_id)

    async def close(self) -> None:
        await self.store.close()

    async def _previous(self, body: dict[str, Any], tenant: str) -> StoredResponse | None:
        previous_id = body.get("previous_response_id")
        if previous_id is None:
            return None
        if not isinstance(previous_id, str):
            raise BadRequest("previous_response_id must be a string",
                             param="previous_response_id")
        found = await self.get(tenant, previous_id)
        if found is None:
            raise BadRequest(f"Response with id '{previous_id}' not found.",
                             param="previous_response_id", status=404)
        return found

    async def _conversation(self, tenant: str, conversation: str) -> list[Any]:
        raw = await self.store.get(tenant, _conversation_key(conversation))
        record = orjson.loads(raw) if raw is not None else {}
        return list(record.get("items") or []) if isinstance(record, dict) else []

    async def _save(self, tenant: str, key: str, record: bytes) -> None:
        """Store a record; the turn is served whether or not it is stored."""
        try:
            stored = await self.store.put(tenant, key, record)
        except StoreUnavailable as exc:
            log.warning("turnkv: the shared store did not answer (%s): a Responses record was "
                        "not stored", exc)
            return
        if not stored:
            log.warning("turnkv: a Responses record of %d bytes is over the store's bound of "
                        "%d bytes a tenant: not stored", len(record),
                        self.store.bounds.max_bytes)


def _conversation_key(conversation: str) -> str:
    # Response IDs are the router's own (`resp_...`): no conversation's key is one.
    return f"conversation:{conversation}"


@dataclass
class _Keeper:
    """Stores one served response, and a conversation's items, once it is whole."""

    service: ResponsesService
    tenant: str
    body: dict[str, Any]
    previous: StoredResponse | None
    conversation: str | None
    input: list[Any]

    async def answered(self, api: ResponsesApi, whole: dict[str, Any]) -> None:
        if self.body.get("store") is not False:
            root = self.previous.root if self.previous is not None else api.response_id
            record = StoredResponse(api.response_id, root, self.input, whole)
            await self.service._save(self.tenant, api.response_id, record.encode())
        if self.conversation is not None:
            items = [*self.input, *(whole.get("output") or [])]
            await self.service._save(self.tenant, _conversation_key(self.conversation),
                                     orjson.dumps({"kind": "conversation", "items": items}))


def _check(body: dict[str, Any]) -> None:
    if body.get("background"):
        raise BadRequest("background responses are not supported by the router: send the "
                         "request and wait for its answer", param="background")
    if not isinstance(body.get("store", True), bool):
        raise BadRequest("store must be a boolean", param="store")
    as_items(body.get("input"))
