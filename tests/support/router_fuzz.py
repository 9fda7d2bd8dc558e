"""Fuzzing the router's HTTP API: what a fuzz case draws, what it sends and what it checks.

Shared by tests/integration/test_router_security.py (a few hundred cases in the test suite,
new on every run: tests/support/fuzz_seed.py) and scripts/fuzz_router.py (10,000 cases and
more, measured outside the suite), so that both fuzz the same API the same way.

A case is one draw of a kind's strategies, built into one or more `Request`s, sent in order
(`play`): a request may name the response an earlier one of its case got (`PREVIOUS`: a
Responses chain, `GET` and `DELETE /v1/responses/{id}`, another tenant's ID). Every answer must
be below 500, read to its end (streamed or not); an error answer (400 and above) must say what
was wrong, in the route's shape (Anthropic's on `/v1/messages`, OpenAI's elsewhere); and a
request that names the statuses it expects (a raw body that is not JSON: 400; another tenant's
response: 404) must get one of them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

from turnkv.protocol import MAX_PRIORITY, MIN_PRIORITY

# The router under fuzz runs with these tenants (--api-keys) and this --admin-key.
KEYS = {"sk-tenant-a-5f1e9c": "tenant-a", "sk-tenant-b-07d2aa": "tenant-b"}
KEY_A, KEY_B = list(KEYS)
ADMIN_KEY = "sk-admin-93be41"
# Put in every prompt a case sends: it must not reach any log.
MARKER = "zebra-quartz-7731"

# -- strategies ------------------------------------------------------------------------------

# JSON has no NaN or infinity (a client library would not send them either).
FLOAT = st.floats(allow_nan=False, allow_infinity=False)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | FLOAT
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=6)
# Any unicode a JSON string can carry: controls, combining marks, astral planes, RTL marks.
ODD = st.text(st.characters(codec="utf-8"), max_size=40)
HINTS = st.dictionaries(
    st.sampled_from(["ttl", "next_turn_in", "final", "priority", "unknown"]),
    st.integers(-10**9, 10**9) | FLOAT | st.booleans() | ODD | JSON, max_size=4)
TAG = st.fixed_dictionaries({}, optional={
    "session_id": ODD | JSON | st.text("abc-_.:", min_size=1, max_size=300),
    "turn": st.integers(-5, 2**64) | JSON,
    "prefix_id": ODD | JSON,
    "hints": HINTS | JSON,
    "unknown": JSON,
})
SESSION_ID = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,20}", fullmatch=True)
VALID_TAG = st.fixed_dictionaries({"session_id": SESSION_ID}, optional={
    "turn": st.integers(0, 10),
    "prefix_id": SESSION_ID,
    "hints": st.fixed_dictionaries({}, optional={
        "ttl": st.floats(0.5, 600), "next_turn_in": st.floats(0, 60), "final": st.booleans(),
        "priority": st.integers(MIN_PRIORITY, MAX_PRIORITY)}),
})
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | JSON,
    "content": ODD.map(lambda s: f"{MARKER} {s}") | JSON,
})
# max_tokens is always there and small (or not a number): a valid request stays short.
MAX_TOKENS = st.integers(-2, 3) | st.text(max_size=4) | st.lists(st.integers(), max_size=2)
CHAT = st.fixed_dictionaries({
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "max_tokens": MAX_TOKENS,
}, optional={
    "model": JSON,
    "stream": st.booleans() | JSON,
    "turnkv": TAG | JSON,
    "n": st.integers(-1, 3),
    "temperature": st.floats(-1, 3) | JSON,
    "return_token_ids": JSON,
    "cache_salt": ODD | JSON,
    "kv_transfer_params": JSON,
    "stream_options": JSON,
    "unknown_field": JSON,
    # Peers' session keys (router/peer_sessions.py), any value.
    "session_id": ODD | JSON,
    "conversation_id": ODD | JSON,
    "prompt_cache_key": ODD | JSON,
    "prompt_cache_retention": st.sampled_from(["in_memory", "24h"]) | JSON,
})
COMPLETION = st.fixed_dictionaries({
    "prompt": ODD.map(lambda s: f"{MARKER} {s}") | JSON,
    "max_tokens": MAX_TOKENS,
}, optional={"turnkv": TAG | JSON, "stream": st.booleans(), "echo": JSON})
HEADERS = st.dictionaries(
    st.sampled_from(["x-turnkv-session", "x-turnkv-turn", "x-turnkv-ttl", "x-turnkv-final",
                     "x-turnkv-priority", "x-turnkv-next-turn-in", "x-turnkv-prefix",
                     "x-session-id", "x-claude-code-session-id", "session_id", "originator"]),
    # (What HTTP lets a client send: visible ASCII, no whitespace at either end.)
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20).map(str.strip),
    max_size=3)
RAW = st.binary(max_size=200) | ODD.map(str.encode)

# The ID of the response an earlier request of the case got (`Chain` fills it in); before any,
# an ID no router ever gave.
PREVIOUS = "{previous-response}"
UNKNOWN_ID = "resp_" + "0" * 32
PROMPT = ODD.map(lambda s: f"{MARKER} {s}")
FUNCTION_TOOL = {"type": "function", "name": "read_file", "description": "Read a file",
                 "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                "required": ["path"]}}
CALL_ID = st.sampled_from(["call_1", "call_2"]) | ODD
RESPONSES_PART = st.fixed_dictionaries({
    "type": st.sampled_from(["input_text", "output_text", "input_image"]) | JSON,
    "text": PROMPT | JSON})
# Input items as clients send them: messages (plain or typed, string or parts), a reply's output
# items sent back (function calls, reasoning), tools' outputs, and anything else.
RESPONSES_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system",
                                                    "developer"]) | JSON,
                           "content": PROMPT | st.lists(RESPONSES_PART, max_size=2) | JSON},
                          optional={"type": st.just("message") | JSON}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": CALL_ID,
                           "name": st.just("read_file") | ODD,
                           "arguments": st.just('{"path": "a.py"}') | ODD | JSON}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": CALL_ID,
                           "output": PROMPT | JSON}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([]) | JSON}),
    JSON)
# Well-formed requests, with odd text and any mix of the API's features: served turns (streamed,
# stored, chained, with tools), which the bodies below, mostly refused, rarely are.
WELL_FORMED_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                           "content": PROMPT}),
    st.fixed_dictionaries({"type": st.just("message"), "role": st.just("user"),
                           "content": st.lists(st.fixed_dictionaries({
                               "type": st.just("input_text"), "text": PROMPT}),
                               min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": PROMPT}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"),
                           "name": st.just("read_file"),
                           "arguments": st.just('{"path": "a.py"}')}),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": st.just("call_1"), "output": PROMPT}))
WELL_FORMED_RESPONSES = st.fixed_dictionaries({
    "input": PROMPT | st.lists(WELL_FORMED_ITEM, min_size=1, max_size=3),
    "max_output_tokens": st.integers(1, 3),
}, optional={
    "store": st.booleans(),
    "stream": st.booleans(),
    "instructions": PROMPT,
    "tools": st.just([FUNCTION_TOOL]),
    "tool_choice": st.sampled_from(["auto", "none"]),
    "previous_response_id": st.just(PREVIOUS),
    "conversation": SESSION_ID,
    "temperature": st.floats(0, 1),
    "prompt_cache_key": SESSION_ID,
})
RESPONSES_BODY = WELL_FORMED_RESPONSES | st.fixed_dictionaries({
    "input": PROMPT | st.lists(RESPONSES_ITEM, max_size=3) | JSON,
    "max_output_tokens": MAX_TOKENS,
}, optional={
    "model": JSON,
    "store": st.booleans() | JSON,
    "stream": st.booleans() | JSON,
    "instructions": PROMPT | JSON,
    "tools": st.just([FUNCTION_TOOL]) | JSON,
    "tool_choice": st.sampled_from(["auto", "none"]) | JSON,
    "previous_response_id": st.just(PREVIOUS) | ODD | JSON,
    "conversation": SESSION_ID | st.fixed_dictionaries({"id": SESSION_ID}) | ODD | JSON,
    "temperature": st.floats(-1, 3) | JSON,
    "prompt_cache_key": ODD | JSON,
    "background": st.booleans() | JSON,
    "enable_response_messages": JSON,
    "turnkv": TAG | JSON,
})
# What may follow a response in its case: a continuation (streamed or not, stored or not),
# another tenant's continuation, and the stored response's own routes, by its tenant or another.
FOLLOW_UPS = st.lists(st.tuples(
    st.sampled_from(["continue", "continue", "foreign", "get", "delete", "get_foreign",
                     "delete_foreign"]), st.booleans(), st.booleans()), max_size=3)
TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": PROMPT}, optional={
    "cache_control": st.just({"type": "ephemeral"}) | JSON})
CONTENT_BLOCK = st.one_of(
    TEXT_BLOCK,
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": CALL_ID,
                           "name": st.just("read_file") | ODD,
                           "input": st.just({"path": "a.py"}) | JSON}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": CALL_ID,
                           "content": PROMPT | st.lists(TEXT_BLOCK, max_size=2) | JSON}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": ODD,
                           "signature": ODD}),
    JSON)
ANTHROPIC_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system"]) | JSON,
    "content": PROMPT | st.lists(CONTENT_BLOCK, max_size=3) | JSON,
})
ANTHROPIC_TOOL = {"name": "read_file", "description": "Read a file",
                  "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
WELL_FORMED_MESSAGES = st.fixed_dictionaries({
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.just("user"), "content": PROMPT | st.lists(TEXT_BLOCK, min_size=1,
                                                               max_size=2)}),
        min_size=1, max_size=1).flatmap(lambda first: st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["assistant", "user"]), "content": PROMPT}),
            max_size=2).map(lambda more: [*first, *more])),
    "max_tokens": st.integers(1, 3),
}, optional={
    "system": PROMPT | st.lists(TEXT_BLOCK, min_size=1, max_size=2),
    "stream": st.booleans(),
    "tools": st.just([ANTHROPIC_TOOL]),
    "temperature": st.floats(0, 1),
})
MESSAGES_BODY = WELL_FORMED_MESSAGES | st.fixed_dictionaries({
    "messages": st.lists(ANTHROPIC_MESSAGE, max_size=3) | JSON,
    "max_tokens": MAX_TOKENS,
}, optional={
    "model": JSON,
    "system": PROMPT | st.lists(TEXT_BLOCK, max_size=2) | JSON,
    "stream": st.booleans() | JSON,
    "tools": st.just([ANTHROPIC_TOOL]) | JSON,
    "tool_choice": st.just({"type": "auto"}) | JSON,
    "thinking": st.fixed_dictionaries({"type": st.just("enabled"),
                                       "budget_tokens": st.integers(-1, 2048)}) | JSON,
    "temperature": st.floats(-1, 3) | JSON,
    "metadata": JSON,
    "turnkv": TAG | JSON,
})
ANTHROPIC_HEADERS = st.dictionaries(
    st.sampled_from(["x-claude-code-session-id", "anthropic-version", "anthropic-beta",
                     "x-session-id", "x-turnkv-session"]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20).map(str.strip),
    max_size=2)

# -- cases -----------------------------------------------------------------------------------


# A request without a body (not even `json=None`, which is what a JSON null hint sends).
NO_BODY: Any = type("NoBody", (), {"__repr__": lambda self: "NO_BODY"})()


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@dataclass(frozen=True)
class Request:
    """One HTTP request of a case, relative to the router's URL."""

    method: str
    path: str
    key: str  # the API key it goes with (a tenant's)
    headers: dict[str, str] = field(default_factory=dict)  # besides the key's
    # The body: JSON (httpx sends none for `json=None`), raw bytes, or none at all.
    json: Any = NO_BODY
    content: bytes | None = None
    # The statuses this request must get; empty: any below 500.
    expect: tuple[int, ...] = ()

    def filled(self, previous: str | None) -> Request:
        """The request with `PREVIOUS` made the response ID `previous` (None: one no router
        gave)."""
        response_id = previous or UNKNOWN_ID
        path = self.path.replace(PREVIOUS, response_id)
        body = self.json
        if isinstance(body, dict) and body.get("previous_response_id") == PREVIOUS:
            body = {**body, "previous_response_id": response_id}
        return dataclasses.replace(self, path=path, json=body)

    def send_kwargs(self) -> dict[str, Any]:
        """What httpx's `request`/`stream` takes besides the method and URL."""
        kwargs: dict[str, Any] = {"headers": {**auth(self.key), **self.headers}}
        if self.content is not None:
            kwargs["content"] = self.content
        elif self.json is not NO_BODY:
            kwargs["json"] = self.json
        return kwargs

    def describe(self) -> dict[str, Any]:
        """The request as a JSON-safe record, without its key (named by tenant)."""
        record: dict[str, Any] = {"method": self.method, "path": self.path,
                                  "tenant": KEYS.get(self.key, "?"), "headers": self.headers}
        if self.content is not None:
            record["content"] = self.content.decode("utf-8", errors="backslashreplace")
        elif self.json is not NO_BODY:
            record["json"] = self.json
        return record


def chat_case(model: str, body: dict[str, Any], headers: dict[str, str]) -> list[Request]:
    """Any chat body (most of them invalid), with any turnkv headers."""
    body.setdefault("model", model)
    return [Request("POST", "/v1/chat/completions", KEY_A, headers=headers, json=body)]


def tagged_turn_case(model: str, content: str, tag: dict[str, Any], headers: dict[str, str],
                     stream: bool) -> list[Request]:
    """Odd unicode in a well-formed turn, and any tag: sessions are opened, renewed,
    refused."""
    body = {"model": model, "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": f"{MARKER} {content}"}], "turnkv": tag}
    return [Request("POST", "/v1/chat/completions", KEY_B, headers=headers, json=body)]


def completion_case(model: str, body: dict[str, Any]) -> list[Request]:
    """Any completions body."""
    body.setdefault("model", model)
    return [Request("POST", "/v1/completions", KEY_B, json=body)]


def raw_body_and_session_routes_case(model: str, raw: bytes, session_id: str,
                                     hints: Any) -> list[Request]:
    """A body that is not a JSON object, and the session routes under any session ID.
    (`model`: unused, for the same signature as the other cases.)"""
    del model
    quoted = f"/v1/turnkv/sessions/{urllib.parse.quote(session_id, safe='')}"
    return [
        Request("POST", "/v1/chat/completions", KEY_A,
                headers={"content-type": "application/json"}, content=raw, expect=(400,)),
        Request("GET", quoted, KEY_A, expect=(400, 404, 405)),
        Request("DELETE", quoted, KEY_A, expect=(400, 404, 405)),
        Request("POST", f"{quoted}/hints", KEY_A, json=hints, expect=(400, 404, 405)),
    ]


def responses_case(model: str, body: dict[str, Any], headers: dict[str, str],
                   follow_ups: list[tuple[str, bool, bool]], raw: bytes) -> list[Request]:
    """Any Responses body (tenant A's), then what may follow the response it got; and a raw
    body that is not a JSON object."""
    body.setdefault("model", model)
    requests = [Request("POST", "/v1/responses", KEY_A, headers=headers, json=body)]
    stored = f"/v1/responses/{PREVIOUS}"
    for what, stream, store in follow_ups:
        key = KEY_B if what.endswith("foreign") else KEY_A
        if what in ("continue", "foreign"):
            requests.append(Request("POST", "/v1/responses", key, json={
                "model": model, "input": f"{MARKER} go on", "previous_response_id": PREVIOUS,
                "max_output_tokens": 2, "stream": stream, "store": store},
                expect=(404,) if key == KEY_B else ()))
        else:
            method = "GET" if what.startswith("get") else "DELETE"
            requests.append(Request(method, stored, key,
                                    expect=(404,) if key == KEY_B else (200, 404)))
    requests.append(Request("POST", "/v1/responses", KEY_A, content=raw,
                            headers={"content-type": "application/json"}, expect=(400,)))
    return requests


def messages_case(model: str, body: dict[str, Any], headers: dict[str, str],
                  raw: bytes) -> list[Request]:
    """Any Messages body with any of Claude Code's and turnkv's headers; and a raw body that
    is not a JSON object."""
    body.setdefault("model", model)
    return [Request("POST", "/v1/messages", KEY_B, headers=headers, json=body),
            Request("POST", "/v1/messages", KEY_B, content=raw,
                    headers={"content-type": "application/json"}, expect=(400,))]


@dataclass(frozen=True)
class CaseKind:
    """A kind of case: the strategies of its arguments, and what builds its requests."""

    strategies: dict[str, st.SearchStrategy[Any]]
    build: Callable[..., list[Request]]


KINDS: dict[str, CaseKind] = {
    "chat": CaseKind({"body": CHAT, "headers": HEADERS}, chat_case),
    "tagged_turn": CaseKind({"content": ODD, "tag": VALID_TAG | TAG,
                             "headers": st.just({}) | HEADERS, "stream": st.booleans()},
                            tagged_turn_case),
    "completion": CaseKind({"body": COMPLETION}, completion_case),
    "raw_body_and_session_routes": CaseKind({"raw": RAW, "session_id": ODD,
                                             "hints": HINTS | JSON},
                                            raw_body_and_session_routes_case),
    "responses": CaseKind({"body": RESPONSES_BODY, "headers": st.just({}) | HEADERS,
                           "follow_ups": FOLLOW_UPS, "raw": RAW}, responses_case),
    "messages": CaseKind({"body": MESSAGES_BODY, "headers": ANTHROPIC_HEADERS, "raw": RAW},
                         messages_case),
}

# -- answers ---------------------------------------------------------------------------------


# A response's ID in an answer (a stream's first event carries it too).
RESPONSE_ID = re.compile(r'"id"\s*:\s*"(resp_[A-Za-z0-9]+)"')


@dataclass(frozen=True)
class Answer:
    status: int
    text: str  # all of it for an error answer (they are short), else its beginning
    response_id: str | None = None  # a Responses answer's


def fetch(client: httpx.Client, router: str, request: Request) -> Answer:
    """Send `request` and read all of its answer (streamed or not)."""
    with client.stream(request.method, f"{router}{request.path}",
                       **request.send_kwargs()) as response:
        response.read()
        text = response.text
        found = RESPONSE_ID.search(text) if response.status_code == 200 else None
        return Answer(response.status_code, text if response.status_code >= 400 else text[:300],
                      found.group(1) if found else None)


class Chain:
    """A case's requests in order, each filled with the response ID the last answer that had
    one got (`Request.filled`)."""

    def __init__(self) -> None:
        self.previous: str | None = None

    def fill(self, request: Request) -> Request:
        return request.filled(self.previous)

    def saw(self, answer: Answer) -> None:
        if answer.response_id is not None:
            self.previous = answer.response_id


def play(client: httpx.Client, router: str, requests: list[Request]) -> Iterator[
        tuple[Request, Answer]]:
    """Send a case's requests in order (each as filled), with their answers."""
    chain = Chain()
    for request in requests:
        sent = chain.fill(request)
        answer = fetch(client, router, sent)
        chain.saw(answer)
        yield sent, answer


def check(status: int, text: str, path: str = "") -> str | None:
    """What is wrong with an answer to a request on `path`, whatever was asked; None if
    nothing is: below 500, and an error (400 and above) says what was wrong in the route's
    shape (Anthropic's on `/v1/messages`, OpenAI's elsewhere)."""
    if status >= 500:
        return f"answered {status}: {text[:300]}"
    if status >= 400:
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return f"answered {status} without a JSON error body: {text[:300]}"
        # The router's and the engines' errors, unknown routes' too (OpenAI's shape, or
        # Anthropic's under /v1/messages: both put the message in `error.message`).
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        if not message:
            return f"answered {status} without saying what was wrong: {text[:300]}"
        assert isinstance(error, dict)
        if path.startswith("/v1/messages"):
            if body.get("type") != "error" or not isinstance(error.get("type"), str):
                return f"answered {status} in another shape than Anthropic's: {text[:300]}"
        elif path and body.get("type") == "error":
            return f"answered {status} in Anthropic's shape, not OpenAI's: {text[:300]}"
    return None


def problem(request: Request, answer: Answer) -> str | None:
    """What is wrong with `answer` to `request`; None if nothing is."""
    wrong = check(answer.status, answer.text, request.path)
    if wrong is None and request.expect and answer.status not in request.expect:
        wrong = f"answered {answer.status}, expected one of {request.expect}: " \
                f"{answer.text[:300]}"
    return wrong
