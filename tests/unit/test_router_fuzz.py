"""The router fuzzer's shared cases (tests/support/router_fuzz.py) against the security
test's own fuzz tests, without a cluster: for the same draws, each kind builds exactly the
requests its test sends (scripts/fuzz_router.py sends the builders'), and answers are judged
alike. And the suite's fuzz is one: each run draws new cases, and a failure says how to draw
them again (tests/support/fuzz_seed.py)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from tests.integration import test_router_security as security
from tests.support.fuzz_seed import fuzz
from tests.support.router_fuzz import (
    KINDS,
    PREVIOUS,
    UNKNOWN_ID,
    Answer,
    Chain,
    Request,
    auth,
    check,
    problem,
)

TESTS = {
    "chat": security.test_fuzzed_chat_requests,
    "tagged_turn": security.test_fuzzed_tags_on_valid_turns,
    "completion": security.test_fuzzed_completion_requests,
    "raw_body_and_session_routes": security.test_fuzzed_bodies_and_session_routes,
    "responses": security.test_fuzzed_responses_requests,
    "messages": security.test_fuzzed_messages_requests,
}
ROUTER = "http://router"


class Recorder:
    """Stands in for the test's httpx client: records each request, answers as a router
    would for the request's kind of route (nothing found by ID, anything else refused), in
    the route's error shape."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    @contextlib.contextmanager
    def stream(self, method: str, url: str, **kwargs: Any) -> Iterator[Any]:
        self.sent.append((method, url, kwargs))
        body = kwargs.get("json")
        unknown = isinstance(body, dict) and body.get("previous_response_id") == UNKNOWN_ID
        found_by_id = "/v1/turnkv/sessions/" in url or "/v1/responses/" in url
        status = 404 if found_by_id or unknown else 400
        text = ('{"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}'
                if "/v1/messages" in url else '{"error": {"message": "no"}}')
        yield SimpleNamespace(status_code=status, text=text, read=lambda: None)


def as_sent(request: Request) -> tuple[str, str, dict[str, Any]]:
    return request.method, f"{ROUTER}{request.path}", request.send_kwargs()


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_builds_the_requests_its_test_sends(kind: str) -> None:
    inner = TESTS[kind].hypothesis.inner_test  # type: ignore[attr-defined]
    cluster = SimpleNamespace(router=ROUTER, served_model_name="tiny")

    @fuzz(30, suppress_health_check=list(HealthCheck))
    @given(st.fixed_dictionaries(KINDS[kind].strategies))
    def same(drawn: dict[str, Any]) -> None:
        client = Recorder()
        inner(cluster=cluster, client=client, **copy.deepcopy(drawn))
        built = KINDS[kind].build("tiny", **copy.deepcopy(drawn))
        chain = Chain()  # (no answer here has a response ID: each is filled with none)
        assert client.sent == [as_sent(chain.fill(r)) for r in built]

    same()


def test_answers_are_judged_as_the_test_judges_them() -> None:
    request = Request("POST", "/v1/chat/completions", "k", expect=(400,))
    assert check(200, "{}") is None
    # Every error is OpenAI's or Anthropic's shape now: FastAPI's own is a finding.
    assert "without saying" in (check(404, '{"detail": "Not Found"}') or "")
    assert check(404, '{"error": {"message": "Invalid URL"}}') is None
    assert check(404, '{"type": "error", "error": {"type": "x", "message": "m"}}') is None
    assert check(400, '{"error": {"message": "bad"}}') is None
    assert "answered 500" in (check(500, "Internal Server Error") or "")
    assert "without saying" in (check(400, '{"error": {"message": ""}}') or "")
    assert "without a JSON error body" in (check(413, "too big") or "")
    assert "expected one of (400,)" in (problem(request, Answer(
        404, '{"error": {"message": "x"}}')) or "")
    assert problem(request, Answer(400, '{"error": {"message": "x"}}')) is None


def test_a_case_names_the_response_an_earlier_request_got() -> None:
    requests = KINDS["responses"].build(
        "tiny", {"input": "x", "max_output_tokens": 1, "previous_response_id": PREVIOUS}, {},
        [("continue", False, True), ("get_foreign", False, False)], b"{")
    chain = Chain()
    first = chain.fill(requests[0])
    assert first.json["previous_response_id"] == UNKNOWN_ID  # none got yet
    chain.saw(Answer(200, "{}", response_id="resp_1"))
    second, third = chain.fill(requests[1]), chain.fill(requests[2])
    assert second.json["previous_response_id"] == "resp_1" and second.key == requests[0].key
    chain.saw(Answer(200, "{}", response_id="resp_2"))
    assert chain.fill(requests[2]).path == "/v1/responses/resp_2"
    assert third.path == "/v1/responses/resp_1" and third.expect == (404,)
    assert third.key != requests[0].key  # another tenant's read of it
    assert requests[-1].expect == (400,) and requests[-1].content == b"{"


def test_errors_are_judged_in_their_routes_shape() -> None:
    openai_shaped = '{"error": {"message": "bad", "type": "invalid_request_error"}}'
    anthropic_shaped = '{"type": "error", "error": {"type": "x", "message": "bad"}}'
    assert check(400, openai_shaped, "/v1/responses") is None
    assert check(400, anthropic_shaped, "/v1/messages") is None
    assert "Anthropic's" in (check(400, openai_shaped, "/v1/messages") or "")
    assert "not OpenAI's" in (check(400, anthropic_shaped, "/v1/responses") or "")


def test_a_recorded_request_names_the_tenant_not_the_key() -> None:
    key = next(iter(security.KEYS))
    request = Request("POST", "/v1/completions", key, json={"prompt": "x"})
    assert request.send_kwargs()["headers"] == auth(key)
    described = request.describe()
    assert key not in repr(described) and described["tenant"] == security.KEYS[key]
