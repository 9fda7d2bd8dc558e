"""Tenants, API keys and bad input, on a real `turnkv` cluster (tiny model, float32).

The router is started with two tenants' API keys and an admin key. Tenants never see, extend
or release each other's sessions, even under the same session ID, and never hit each other's
cached prefixes. Then the router's HTTP API is fuzzed (hypothesis), the Responses and Messages
APIs too: whatever arrives gets an answer below 500, errors in each route's shape, the router
and its engines stay healthy, the Responses store stays within its bounds, and once the
engines' leases run out no KV block is left in use. Last, no log of the cluster holds a key or
a prompt.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import (
    FIXED_POOLS,
    SHORT_LEASE_S,
    SHORT_LEASES,
    ClusterSpec,
    RouterView,
)
from tests.support.fuzz_seed import fuzz
from tests.support.router_fuzz import (
    ADMIN_KEY,
    CHAT,
    COMPLETION,
    FUNCTION_TOOL,
    HEADERS,
    HINTS,
    JSON,
    KEY_A,
    KEY_B,
    KEYS,
    KINDS,
    MARKER,
    ODD,
    PREVIOUS,
    TAG,
    VALID_TAG,
    Request,
    auth,
    check,
    play,
    problem,
)
from tests.support.waiting import wait_for as wait_for_condition
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import ClusterState

# Engine leases end this soon after a turn, so that a fuzzed session's KV comes back quickly.
ENGINE_LEASE_S = SHORT_LEASE_S
# Long enough for a full 128-token block with the tiny model's byte-level tokenizer.
SHARED_PROMPT = f"{MARKER} " + " ".join(f"fact {i}: the sky is blue." for i in range(40))
# The Responses store's bounds per tenant, small: the fuzzed responses go past both.
RESPONSES_MAX_COUNT = 4
RESPONSES_MAX_BYTES = 8192


@contextmanager
def tenants(run_dir: Path) -> Iterator[tuple[str, ...]]:
    """The router's two tenants' API keys and the admin key; the Responses store's bounds."""
    keys_file = run_dir / "api-keys.json"
    keys_file.write_text(json.dumps(KEYS))
    yield ("--api-keys", str(keys_file), "--admin-key", ADMIN_KEY,
           "--responses-max-count", str(RESPONSES_MAX_COUNT),
           "--responses-max-bytes", str(RESPONSES_MAX_BYTES))


# In fixed pools: the tenants' isolation is read off the prefill engine's cache hits.
CLUSTER = ClusterSpec("security", SHORT_LEASES, RouterView(args=FIXED_POOLS, service=tenants))
pytestmark = pytest.mark.cluster(CLUSTER)


@pytest.fixture
def cluster(clusters: ClusterPool) -> ClusterState:
    return clusters.get(CLUSTER)[1]


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as c:
        yield c


def chat(state: ClusterState, client: httpx.Client, key: str, content: str,
         tag: dict[str, Any] | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": state.served_model_name, "max_tokens": 2,
                            "temperature": 0,
                            "messages": [{"role": "user", "content": content}]}
    if tag is not None:
        body["turnkv"] = tag
    return client.post(f"{state.router}/v1/chat/completions", json=body, headers=auth(key))


# This module's pace: its waits are for what takes about this long.
wait_for = partial(wait_for_condition, timeout=60.0, interval=0.3)


def test_keys_are_required_and_admin_routes_need_the_admin_key(
        cluster: ClusterState, client: httpx.Client) -> None:
    router = cluster.router
    for headers in ({}, auth("sk-unknown"), {"authorization": KEY_A},  # not "Bearer ..."
                    {"authorization": "Basic " + KEY_A}):
        response = client.post(f"{router}/v1/chat/completions", headers=headers,
                               json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 401, headers
        assert response.json()["error"]["type"] == "authentication_error"
        assert client.get(f"{router}/v1/models", headers=headers).status_code == 401
        assert client.get(f"{router}/v1/turnkv/sessions/any", headers=headers
                          ).status_code == 401
    assert client.get(f"{router}/v1/models", headers=auth(KEY_A)).status_code == 200
    for key in (KEY_A, KEY_B):
        assert client.get(f"{router}/v1/turnkv/stats", headers=auth(key)).status_code == 403
        assert client.get(f"{router}/metrics", headers=auth(key)).status_code == 403
    assert client.get(f"{router}/v1/turnkv/stats").status_code == 403
    assert client.get(f"{router}/v1/turnkv/stats", headers=auth(ADMIN_KEY)).status_code == 200
    assert client.get(f"{router}/metrics", headers=auth(ADMIN_KEY)).status_code == 200
    # Load balancers probe without a key.
    assert client.get(f"{router}/health").status_code == 200


def test_tenants_cannot_see_extend_or_release_each_others_sessions(
        cluster: ClusterState, client: httpx.Client) -> None:
    sessions = f"{cluster.router}/v1/turnkv/sessions"
    first = chat(cluster, client, KEY_A, f"{MARKER} hello", {"session_id": "same-name"})
    assert first.status_code == 200
    # B, with A's session ID: the same answers as for a session that does not exist.
    for request in (lambda: client.get(f"{sessions}/same-name", headers=auth(KEY_B)),
                    lambda: client.delete(f"{sessions}/same-name", headers=auth(KEY_B)),
                    lambda: client.post(f"{sessions}/same-name/hints", headers=auth(KEY_B),
                                        json={"ttl": 1})):
        response = request()
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "no live session 'same-name'"
    # B's turn under that ID opens B's own session; A's is untouched.
    assert chat(cluster, client, KEY_B, f"{MARKER} hi", {"session_id": "same-name"}
                ).status_code == 200
    a = client.get(f"{sessions}/same-name", headers=auth(KEY_A)).json()
    b = client.get(f"{sessions}/same-name", headers=auth(KEY_B)).json()
    assert a["turns"] == b["turns"] == 1
    assert a["expires_in_s"] > 60  # B's hints above did not shorten it
    assert client.delete(f"{sessions}/same-name", headers=auth(KEY_B)).json()["released"]
    assert client.get(f"{sessions}/same-name", headers=auth(KEY_A)).json()["turns"] == 1
    assert client.delete(f"{sessions}/same-name", headers=auth(KEY_A)).json()["released"]


def test_tenants_never_hit_each_others_cached_prefixes(
        clusters: ClusterPool, client: httpx.Client) -> None:
    cluster = clusters.clean(CLUSTER)[1]  # nothing cached: no hit but the test's own

    def cached(key: str, salt: str | None = None) -> int:
        body = {"model": cluster.served_model_name, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": SHARED_PROMPT}]}
        if salt is not None:
            body["cache_salt"] = salt
        response = client.post(f"{cluster.router}/v1/chat/completions", json=body,
                               headers=auth(key))
        assert response.status_code == 200
        return int(response.json()["turnkv"]["prompt_tokens"]["prefill_cached"])

    assert cached(KEY_A) == 0
    assert cached(KEY_A) > 0  # A's own prefix is cached...
    assert cached(KEY_B) == 0  # ...B's identical prompt does not hit it
    # A client's own salt is scoped by the tenant's: B cannot pick A's salt.
    assert cached(KEY_A, "team") == 0
    assert cached(KEY_B, "team") == 0
    assert cached(KEY_A, "team") > 0


# -- bad input -------------------------------------------------------------------------------
# The strategies, and how an answer is checked, are shared with scripts/fuzz_router.py (10,000
# cases and more, outside the suite): tests/support/router_fuzz.py, whose `KINDS` build the
# same requests as the four tests below. Each run draws new cases from the run's seed
# (tests/support/fuzz_seed.py: a failure says how to replay it); the `@example`s are the cases
# that once found a fault, run every time.

FUZZ = fuzz(60, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


def answered(response: httpx.Response, path: str) -> int:
    """Read all of the answer (streamed or not); its status, which must be below 500 (and an
    error must say what was wrong, in the route's shape: `router_fuzz.check`)."""
    response.read()
    wrong = check(response.status_code, response.text, path)
    assert wrong is None, wrong
    return response.status_code


def send(client: httpx.Client, method: str, url: str, **kwargs: Any) -> int:
    with client.stream(method, url, **kwargs) as response:
        return answered(response, urllib.parse.urlsplit(url).path)


def send_case(client: httpx.Client, router: str, requests: list[Request]) -> list[int]:
    """A case's requests in order (`router_fuzz.play`), each answer judged: their statuses."""
    statuses = []
    for request, answer in play(client, router, requests):
        wrong = problem(request, answer)
        assert wrong is None, f"{request.describe()}: {wrong}"
        statuses.append(answer.status)
    return statuses


@FUZZ
# An empty prompt in a tagged turn: /tokenize refuses it, which once made the router answer
# 503 and take the engine for unavailable.
@example(body={"messages": [{"role": "user", "content": ""}], "max_tokens": 1,
               "turnkv": {"session_id": "fuzz-empty-prompt"}}, headers={})
@given(body=CHAT, headers=HEADERS)
def test_fuzzed_chat_requests(cluster: ClusterState, client: httpx.Client,
                              body: dict[str, Any], headers: dict[str, str]) -> None:
    body.setdefault("model", cluster.served_model_name)
    send(client, "POST", f"{cluster.router}/v1/chat/completions", json=body,
         headers={**auth(KEY_A), **headers})


@FUZZ
# Valid turns, served whatever the seed draws.
@example(content="hello", tag={"session_id": "fuzz-valid", "hints": {"final": True}},
         headers={}, stream=False)
@example(content="", tag={"session_id": "fuzz-valid-streamed", "turn": 1}, headers={},
         stream=True)
@given(content=ODD, tag=VALID_TAG | TAG, headers=st.just({}) | HEADERS, stream=st.booleans())
def test_fuzzed_tags_on_valid_turns(cluster: ClusterState, client: httpx.Client, content: str,
                                    tag: dict[str, Any], headers: dict[str, str],
                                    stream: bool) -> None:
    # Odd unicode in a well-formed turn, and any tag: sessions are opened, renewed, refused.
    body = {"model": cluster.served_model_name, "max_tokens": 2, "stream": stream,
            "messages": [{"role": "user", "content": f"{MARKER} {content}"}], "turnkv": tag}
    send(client, "POST", f"{cluster.router}/v1/chat/completions", json=body,
         headers={**auth(KEY_B), **headers})


@FUZZ
# A batch of prompts: both engine requests once carried the same transfer, and the second
# waited out the receive timeout.
@example(body={"prompt": [f"{MARKER} a", f"{MARKER} b"], "max_tokens": 1,
               "turnkv": {"session_id": "fuzz-batch"}})
@given(body=COMPLETION)
def test_fuzzed_completion_requests(cluster: ClusterState, client: httpx.Client,
                                    body: dict[str, Any]) -> None:
    body.setdefault("model", cluster.served_model_name)
    send(client, "POST", f"{cluster.router}/v1/completions", json=body, headers=auth(KEY_B))


@FUZZ
# Session IDs that end in a slash: the web framework once redirected them to the ID without
# it, another session.
@example(raw=b"", session_id="\xd3\x18\xe9\xe2/", hints={})
@example(raw=b"{", session_id="abc/", hints={"final": True})
@given(raw=st.binary(max_size=200) | ODD.map(str.encode), session_id=ODD,
       hints=HINTS | JSON)
def test_fuzzed_bodies_and_session_routes(cluster: ClusterState, client: httpx.Client,
                                          raw: bytes, session_id: str, hints: Any) -> None:
    router, headers = cluster.router, {**auth(KEY_A), "content-type": "application/json"}
    assert send(client, "POST", f"{router}/v1/chat/completions", content=raw,
                headers=headers) == 400
    quoted = f"{router}/v1/turnkv/sessions/{urllib.parse.quote(session_id, safe='')}"
    for method, url, extra in (("GET", quoted, {}), ("DELETE", quoted, {}),
                               ("POST", f"{quoted}/hints", {"json": hints})):
        assert send(client, method, url, headers=auth(KEY_A), **extra) in (400, 404, 405)


# Fewer cases than the other kinds: more of them are served turns (a Responses case is up to
# four), which take the tiny engines a moment each.
API_FUZZ = fuzz(20, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


@API_FUZZ
# A response, continued, read back and deleted; another tenant's continuation and reads of it.
@example(body={"input": f"{MARKER} hello", "max_output_tokens": 2, "store": True},
         headers={}, raw=b"{", follow_ups=[("continue", True, True), ("get", False, False),
                                           ("foreign", False, True),
                                           ("get_foreign", False, False),
                                           ("delete", False, False)])
# Codex's way: the whole history, function calls and their outputs, nothing stored.
@example(body={"instructions": f"{MARKER} be brief", "store": False, "stream": True,
               "max_output_tokens": 2, "tools": [FUNCTION_TOOL],
               "input": [{"role": "user", "content": f"{MARKER} read a.py"},
                         {"type": "function_call", "call_id": "call_1", "name": "read_file",
                          "arguments": '{"path": "a.py"}'},
                         {"type": "function_call_output", "call_id": "call_1",
                          "output": f"{MARKER} print()"}]},
         headers={}, raw=b"[]", follow_ups=[("delete_foreign", False, False)])
# An unknown previous response, and a conversation.
@example(body={"input": f"{MARKER} hi", "max_output_tokens": 1,
               "previous_response_id": PREVIOUS}, headers={}, raw=b"", follow_ups=[])
@example(body={"input": f"{MARKER} hi", "max_output_tokens": 1, "conversation": "fuzz-conv"},
         headers={}, raw=b"null", follow_ups=[("continue", False, False)])
@given(**KINDS["responses"].strategies)
def test_fuzzed_responses_requests(cluster: ClusterState, client: httpx.Client,
                                   body: dict[str, Any], headers: dict[str, str],
                                   follow_ups: list[tuple[str, bool, bool]], raw: bytes) -> None:
    send_case(client, cluster.router, KINDS["responses"].build(
        cluster.served_model_name, body, headers, follow_ups, raw))


@API_FUZZ
# Claude Code's turn: its session header, system blocks, a tool's use and its result.
@example(body={"system": [{"type": "text", "text": f"{MARKER} be brief",
                           "cache_control": {"type": "ephemeral"}}],
               "max_tokens": 2, "stream": True,
               "messages": [{"role": "user", "content": f"{MARKER} read a.py"},
                            {"role": "assistant", "content": [
                                {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                 "input": {"path": "a.py"}}]},
                            {"role": "user", "content": [
                                {"type": "tool_result", "tool_use_id": "toolu_1",
                                 "content": f"{MARKER} print()"}]}]},
         headers={"x-claude-code-session-id": "fuzz-claude"}, raw=b"{")
@example(body={"messages": "not a list", "max_tokens": 1}, headers={}, raw=b"[1]")
@given(**KINDS["messages"].strategies)
def test_fuzzed_messages_requests(cluster: ClusterState, client: httpx.Client,
                                  body: dict[str, Any], headers: dict[str, str],
                                  raw: bytes) -> None:
    send_case(client, cluster.router, KINDS["messages"].build(
        cluster.served_model_name, body, headers, raw))


def responses_stored(client: httpx.Client, router: str) -> dict[str, dict[str, float]]:
    """The router's `turnkv_responses_stored` and `turnkv_responses_bytes`, by tenant."""
    text = client.get(f"{router}/metrics", headers=auth(ADMIN_KEY)).text
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("turnkv_responses_stored", "turnkv_responses_bytes"):
            for sample in family.samples:
                found.setdefault(sample.labels["tenant"], {})[family.name] = sample.value
    return found


def test_a_huge_body_is_refused(cluster: ClusterState, client: httpx.Client) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (17 * 2**20)}],
                       "max_tokens": 1}).encode()
    response = client.post(f"{cluster.router}/v1/chat/completions", content=body,
                           headers={**auth(KEY_A), "content-type": "application/json"})
    assert response.status_code == 413


def test_after_the_fuzzing_everything_is_healthy_and_no_kv_is_left(
        clusters: ClusterPool, client: httpx.Client) -> None:
    """Fuzzed chat requests, tagged turns, Responses and Messages cases of its own, on a clean
    cluster: then every engine is healthy, the Responses store holds no more than its bounds,
    and once the sessions' engine leases run out no block is in use."""
    cluster = clusters.clean(CLUSTER)[1]
    tried: dict[str, int] = {}

    def count(status: int) -> None:
        tried[f"{status // 100}xx"] = tried.get(f"{status // 100}xx", 0) + 1

    @fuzz(30, suppress_health_check=[HealthCheck.too_slow])
    @example(body={"messages": "not a list"}, headers={})  # refused, whatever the seed
    @given(body=CHAT, headers=HEADERS)
    def chat_requests(body: dict[str, Any], headers: dict[str, str]) -> None:
        body.setdefault("model", cluster.served_model_name)
        count(send(client, "POST", f"{cluster.router}/v1/chat/completions", json=body,
                   headers={**auth(KEY_A), **headers}))

    @fuzz(30, suppress_health_check=[HealthCheck.too_slow])
    @example(content="hello", tag={"session_id": "fuzz-after", "hints": {"final": True}},
             stream=False)
    @given(content=ODD, tag=VALID_TAG | TAG, stream=st.booleans())
    def tagged_turns(content: str, tag: dict[str, Any], stream: bool) -> None:
        body = {"model": cluster.served_model_name, "max_tokens": 2, "stream": stream,
                "messages": [{"role": "user", "content": f"{MARKER} {content}"}],
                "turnkv": tag}
        count(send(client, "POST", f"{cluster.router}/v1/chat/completions", json=body,
                   headers=auth(KEY_B)))

    @fuzz(8, suppress_health_check=[HealthCheck.too_slow])
    # A chain longer than the store's count bound, each record bigger than the last.
    @example(body={"input": f"{MARKER} hello", "max_output_tokens": 2}, headers={}, raw=b"",
             follow_ups=[("continue", n % 2 == 0, True) for n in range(RESPONSES_MAX_COUNT + 1)])
    @given(**KINDS["responses"].strategies)
    def responses_cases(**drawn: Any) -> None:
        for status in send_case(client, cluster.router, KINDS["responses"].build(
                cluster.served_model_name, **drawn)):
            count(status)

    @fuzz(8, suppress_health_check=[HealthCheck.too_slow])
    @given(**KINDS["messages"].strategies)
    def messages_cases(**drawn: Any) -> None:
        for status in send_case(client, cluster.router, KINDS["messages"].build(
                cluster.served_model_name, **drawn)):
            count(status)

    chat_requests()
    tagged_turns()
    responses_cases()
    messages_cases()
    print(f"fuzzed requests by answer: {dict(sorted(tried.items()))}")
    # Within its bounds, each tenant's; the chain above stored more than they hold.
    stored = responses_stored(client, cluster.router)
    print(f"Responses store by tenant: {stored}")
    assert stored.get("tenant-a", {}).get("turnkv_responses_stored", 0) > 0, stored
    for tenant, held in stored.items():
        assert held["turnkv_responses_stored"] <= RESPONSES_MAX_COUNT, (tenant, held)
        assert held["turnkv_responses_bytes"] <= RESPONSES_MAX_BYTES, (tenant, held)
    # A valid turn among the examples, whatever the seed: some were served (and left KV
    # behind to give back), some refused.
    assert tried.get("2xx", 0) > 0 and tried.get("4xx", 0) > 0, tried

    def stats() -> dict[str, Any]:
        return dict(client.get(f"{cluster.router}/v1/turnkv/stats",
                               headers=auth(ADMIN_KEY)).json())
    assert all(engine["healthy"] for engine in stats()["engines"])
    # What the fuzzed turns left for after them (give-ups of sends, releases) ends too.
    wait_for(lambda: all(engine["in_flight"] == 0 for engine in stats()["engines"]),
             "no engine request in flight", timeout=30.0)
    assert chat(cluster, client, KEY_A, f"{MARKER} still there?").status_code == 200
    # The fuzzed sessions' leases run out on the engines (they expire lazily, on the next
    # request); then every block is free again.
    engines = [url for urls in cluster.endpoints().values() if isinstance(urls, list)
               for url in urls]
    time.sleep(ENGINE_LEASE_S + 1)

    def empty() -> bool:
        # A session that ends with its turn: it holds nothing after (an untagged chat turn
        # would be a session of its own, held under a lease).
        chat(cluster, client, KEY_B, f"{MARKER} tick",
             tag={"session_id": "tick", "hints": {"final": True}})
        return all(fetch_connector_counters(url).get("kv_cache_usage") == 0
                   for url in engines)
    wait_for(empty, "every KV block free on both engines")


def test_no_log_holds_a_key_or_a_prompt(cluster: ClusterState, client: httpx.Client) -> None:
    """Every log of the engines, and of every router this module ran (the pool starts one
    anew for a test that needs it clean), after keyed requests and a prompt of this test's
    own, besides whatever the tests before it sent."""
    assert chat(cluster, client, KEY_A, f"{MARKER} hello", {"session_id": "logged"}
                ).status_code == 200
    assert chat(cluster, client, KEY_B, f"{MARKER} hi").status_code == 200
    assert client.get(f"{cluster.router}/v1/turnkv/stats", headers=auth(ADMIN_KEY)
                      ).status_code == 200
    engines = [Path(server.log) for server in cluster.engines if server.log]
    # The router writes nothing at its default level; the engines write their start-up.
    assert len(engines) == 2 and all(log.exists() and log.stat().st_size for log in engines)
    assert cluster.router_process is not None and cluster.router_process.log
    routers = sorted(Path(cluster.run_dir).parent.glob(f"{CLUSTER.name}*/logs/router.log"))
    assert Path(cluster.router_process.log) in routers, routers
    for log in [*engines, *routers]:
        text = log.read_text(errors="replace")
        for secret in (*KEYS, ADMIN_KEY, MARKER):
            assert secret not in text, f"{log.name} holds {secret!r}"
