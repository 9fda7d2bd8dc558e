"""Fuzzing the router's HTTP API: what a fuzz case draws, what it sends and what it checks.

Shared by tests/integration/test_router_security.py (a few hundred cases in the test suite,
new on every run: tests/support/fuzz_seed.py) and scripts/fuzz_router.py (10,000 cases and
more, measured outside the suite), so that both fuzz the same API the same way.

A case is one draw of a kind's strategies, built into one or more `Request`s. Every answer must
be below 500, read to its end (streamed or not); an error answer (400 and above) must say what
was wrong; and a request that names the statuses it expects (a raw body that is not JSON: 400)
must get one of them.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable
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
}

# -- answers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    text: str  # all of it for an error answer (they are short), else its beginning


def fetch(client: httpx.Client, router: str, request: Request) -> Answer:
    """Send `request` and read all of its answer (streamed or not)."""
    with client.stream(request.method, f"{router}{request.path}",
                       **request.send_kwargs()) as response:
        response.read()
        text = response.text
        return Answer(response.status_code, text if response.status_code >= 400 else text[:300])


def check(status: int, text: str) -> str | None:
    """What is wrong with an answer, whatever was asked; None if nothing is: below 500, and
    an error (400 and above) says what was wrong."""
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
    return None


def problem(request: Request, answer: Answer) -> str | None:
    """What is wrong with `answer` to `request`; None if nothing is."""
    wrong = check(answer.status, answer.text)
    if wrong is None and request.expect and answer.status not in request.expect:
        wrong = f"answered {answer.status}, expected one of {request.expect}: " \
                f"{answer.text[:300]}"
    return wrong
