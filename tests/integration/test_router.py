"""The session router on real clusters (tiny model, float32): one prefill, two decode engines,
in each serving mode.

Every turn is checked against a single engine's greedy output for the same conversation.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import FIXED_POOLS, MODES, TINY_ENGINES, ClusterSpec, RouterView
from tests.support.conversation import USER_TURNS
from tests.support.oracle import Completion, RoutedCompletion, compare, routed_chat
from tests.support.reference import ROUTER_SCRIPT, Reference, References
from turnkv_server.engine.metrics import sum_samples
from turnkv_server.launcher import Cluster, ClusterState

TURNS = ROUTER_SCRIPT.turns
EDITED_AT = ROUTER_SCRIPT.edited_at  # the turn whose history rewrites turn 1's assistant message
MAX_TOKENS = ROUTER_SCRIPT.max_tokens
# One prefill and two decode engines per mode, behind a router of their own. Health probes
# off: the failover test then meets the dead engine itself. (The turnkv and bidirectional
# engines serve other modules' routers before this one's: `tests.support.clusters`.)
# turnkv in fixed pools: these tests read the P/D form's stats (test_planner_placements.py
# plays the planner's placements).
CLUSTERS = {mode: ClusterSpec(f"router-{mode}", TINY_ENGINES[mode], RouterView(
    prefill=1, decode=2, args=("--health-interval", "3600",
                               *(FIXED_POOLS if mode == "turnkv" else ()))))
    for mode in MODES}


@pytest.fixture(scope="module")
def reference(tiny_references: References) -> Reference:
    return tiny_references[ROUTER_SCRIPT]


@pytest.fixture(params=[pytest.param(mode, marks=pytest.mark.cluster(CLUSTERS[mode]))
                        for mode in MODES])
def cluster(request: pytest.FixtureRequest, clusters: ClusterPool
            ) -> tuple[Cluster, ClusterState]:
    return clusters.get(CLUSTERS[request.param])


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as c:
        yield c


def _assert_same(ref: Completion, out: RoutedCompletion, turn: int) -> None:
    verdict = compare(ref, out.completion)
    print(f"turn {turn}: {verdict.describe()}; stats {out.stats['prompt_tokens']}")
    assert verdict.acceptable, f"turn {turn}: {verdict.describe()}"


def fallbacks_for_engines(client: httpx.Client, state: ClusterState) -> float:
    """The router's turns moved off an engine it could not reach."""
    return sum_samples(client.get(f"{state.router}/metrics").text, {
        "n": ("turnkv_fallbacks", "_total", ("reason", "engine_unavailable"))}).get("n", 0.0)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_five_turns_equal_a_single_engine_and_standard_recomputes(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client,
    stream: bool,
) -> None:
    _, state = cluster
    # Both variants play the same conversation: separate cache salts keep the second from
    # hitting the first one's prefixes on the prefill engine.
    session_id = f"five-{'sse' if stream else 'json'}"
    held_before: int | None = None
    prompt_before: int | None = None
    for turn in range(1, TURNS + 1):
        out = routed_chat(state.router, state.served_model_name, reference.messages[turn - 1],
                          MAX_TOKENS, session={"session_id": session_id}, stream=stream,
                          client=client, extra={"cache_salt": session_id})
        _assert_same(reference.turns[turn - 1], out, turn)
        stats = out.stats
        tokens = stats["prompt_tokens"]
        assert stats["session_id"] == session_id and stats["turn"] == turn
        assert stats["mode"] == state.mode
        if prompt_before is None:
            assert stats["prefix_break_at"] is None
        elif stats["prefix_break_at"] is not None:
            # The random model's output is not how its tokenizer would encode the same text:
            # re-tokenised assistant text may break the history, but only after the previous
            # prompt, which the new prompt repeats verbatim.
            assert stats["prefix_break_at"] >= prompt_before
        assert tokens["total"] == out.completion.usage["prompt_tokens"]
        # turnkv serves a short delta on the decode engine alone, with no prefill request.
        alone = stats["prefill_node"] is None
        assert alone == (state.mode == "turnkv" and turn > 1)
        if alone:
            assert tokens["decode_cached"] + tokens["decode_computed"] == tokens["total"]
        else:
            assert tokens["prefill_reused"] + tokens["prefill_computed"] == tokens["total"]
        assert out.headers.get("x-turnkv-prefill-computed") == (
            None if alone else str(tokens["prefill_computed"]))
        assert stats["completion_tokens"] == len(out.completion.token_ids)
        if held_before is not None:
            shared = stats["prefix_break_at"] or held_before
            new_tokens = tokens["total"] - shared
            if state.mode == "bidirectional":
                # The prefill engine read the history back from the decode engine and
                # computed only the new tokens (plus the one vLLM always recomputes).
                assert tokens["prefill_computed"] <= new_tokens + 1
            elif state.mode == "turnkv":
                # Every later turn here is a short delta: the decode engine, which holds the
                # session's history, computes the new tokens from its last full block
                # (prefix hits are whole blocks; the tiny model's are 128 tokens).
                assert tokens["decode_computed"] < new_tokens + 128
            else:
                # The prefill engine never held the previous turn's output: it computes
                # more than the new tokens.
                assert tokens["prefill_computed"] > new_tokens
        session = client.get(f"{state.router}/v1/turnkv/sessions/{session_id}").json()
        assert session["turns"] == turn
        held_before = session["tokens_held"]
        assert held_before == tokens["total"] + len(out.completion.token_ids)
        prompt_before = tokens["total"]


def test_edited_history_is_detected_and_output_stays_exact(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    _, state = cluster
    session = {"session_id": "edited"}
    first_prompt = 0
    for turn in range(1, EDITED_AT):
        out = routed_chat(state.router, state.served_model_name, reference.messages[turn - 1],
                          MAX_TOKENS, session=session, stream=False, client=client)
        _assert_same(reference.turns[turn - 1], out, turn)
        first_prompt = first_prompt or out.stats["prompt_tokens"]["total"]
    out = routed_chat(state.router, state.served_model_name, reference.edited_messages,
                      MAX_TOKENS, session=session, stream=True, client=client)
    _assert_same(reference.edited_turn, out, EDITED_AT)
    # Turn 1's reply was rewritten: the history breaks right where that reply starts, after
    # turn 1's prompt and the assistant header.
    break_at = out.stats["prefix_break_at"]
    assert break_at is not None and first_prompt <= break_at < first_prompt + 8
    assert out.headers["x-turnkv-prefix-break-at"] == str(break_at)


def test_session_api_and_bad_input(reference: Reference, cluster: tuple[Cluster, ClusterState],
                                   client: httpx.Client) -> None:
    _, state = cluster
    url = f"{state.router}/v1/turnkv/sessions"
    session = {"session_id": "api"}
    for turn in (1, 2):
        out = routed_chat(state.router, state.served_model_name, reference.messages[turn - 1],
                          MAX_TOKENS, session=session, stream=False, client=client,
                          extra={"cache_salt": "api"})
        _assert_same(reference.turns[turn - 1], out, turn)
    assert client.get(f"{url}/api").json()["turns"] == 2
    renewed = client.post(f"{url}/api/hints", json={"ttl": 5, "priority": 3}).json()
    assert 0 < renewed["expires_in_s"] <= 5 and renewed["priority"] == 3
    bad = client.post(f"{url}/api/hints", json={"ttl": -1})
    assert bad.status_code == 400 and "ttl" in bad.json()["error"]["message"]
    assert client.delete(f"{url}/api").json()["released"] is True
    assert client.get(f"{url}/api").status_code == 404
    assert client.get(f"{url}/not..valid!").status_code in (400, 404)

    chat = f"{state.router}/v1/chat/completions"
    base = {"model": state.served_model_name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    for tag, field_name in [({"session_id": "bad id with spaces"}, "session_id"),
                            ({"session_id": "ok", "hints": {"priority": 99}}, "priority"),
                            ({"session_id": "ok", "unknown": 1}, "unknown")]:
        response = client.post(chat, json={**base, "turnkv": tag})
        assert response.status_code == 400, tag
        assert field_name in response.json()["error"]["message"]
    header_tag = client.post(chat, json=base, headers={"X-TurnKV-Session": "hdr",
                                                       "X-TurnKV-TTL": "0"})
    assert header_tag.status_code == 400 and "ttl" in header_tag.json()["error"]["message"]
    assert client.post(chat, json={**base, "n": 2}).status_code == 400
    assert client.post(chat, content=b"{oops", headers={"content-type": "application/json"}
                       ).status_code == 400
    stats = client.get(f"{state.router}/v1/turnkv/stats").json()
    assert stats["mode"] == state.mode and len(stats["engines"]) == 3


@pytest.mark.cluster(CLUSTERS["turnkv"])
def test_peers_dialects_reuse_the_session_as_the_turnkv_tag_does(
    reference: Reference, clusters: ClusterPool, client: httpx.Client
) -> None:
    """Dynamo's session header, `nvext.session_control` and `nvext.agent_hints`, and OpenAI's
    `prompt_cache_key`, where the five-turn test sends the turnkv tag (docs/protocol.md,
    "Peers' dialects"): the same outputs and the same reuse, in turnkv mode (the dialects are
    the router's reading of a request, the same in every mode)."""
    _, state = clusters.get(CLUSTERS["turnkv"])
    session_id = "dialect-run:researcher"
    held_before: int | None = None
    for turn in range(1, TURNS + 1):
        headers = {"x-dynamo-session-id": session_id}
        extra: dict[str, object] = {"cache_salt": session_id, "prompt_cache_key": "script"}
        if turn == 1:
            extra["nvext"] = {"session_control": {"session_id": session_id, "action": "open",
                                                  "timeout": 600},
                              "agent_hints": {"priority": 5, "osl": MAX_TOKENS}}
        if turn == TURNS:
            headers["x-dynamo-session-final"] = "true"
        out = routed_chat(state.router, state.served_model_name, reference.messages[turn - 1],
                          MAX_TOKENS, session=None, stream=turn % 2 == 0, client=client,
                          headers=headers, extra=extra)
        _assert_same(reference.turns[turn - 1], out, turn)
        stats, tokens = out.stats, out.stats["prompt_tokens"]
        assert stats["session_id"] == session_id and stats["turn"] == turn
        # As under the turnkv tag: every later turn is a short delta, which the decode engine
        # holding the session's history computes from its last full block.
        assert (stats["prefill_node"] is None) == (turn > 1)
        if held_before is not None:
            shared = stats["prefix_break_at"] or held_before
            assert tokens["decode_computed"] < tokens["total"] - shared + 128
        record = client.get(f"{state.router}/v1/turnkv/sessions/{session_id}")
        if turn == TURNS:
            assert record.status_code == 404  # X-Dynamo-Session-Final ended it
            break
        session = record.json()
        assert session["turns"] == turn and session["priority"] == 5
        assert session["prefix_id"].startswith("pck-")
        # The open's timeout is the first lease; later turns renew the router's default.
        assert (300 < session["expires_in_s"] <= 600) == (turn == 1)
        held_before = session["tokens_held"]
        assert held_before == tokens["total"] + len(out.completion.token_ids)


def test_a_killed_decode_engine_falls_back_to_the_other_pair(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    launched, state = cluster
    fallbacks = fallbacks_for_engines(client, state)
    session = {"session_id": "failover"}
    first = routed_chat(state.router, state.served_model_name, reference.messages[0],
                        MAX_TOKENS, session=session, stream=False, client=client)
    _assert_same(reference.turns[0], first, 1)
    victim = next(e for e in launched.engines if e.spec.name == first.stats["decode_node"])
    victim.stop()  # the whole process group, as a crash would leave it

    # The round robin sends one of two sessionless turns to the dead engine: both are
    # answered. (Plain completions: an untagged chat turn would be a session the router
    # infers from its conversation, placed like any new session.)
    for _ in range(2):
        plain = client.post(f"{state.router}/v1/completions", json={
            "model": state.served_model_name, "prompt": USER_TURNS[0],
            "max_tokens": MAX_TOKENS, "temperature": 0})
        assert plain.status_code == 200, plain.text
        assert plain.json()["turnkv"]["session_id"] is None
    assert fallbacks_for_engines(client, state) == fallbacks + 1
    health = client.get(f"{state.router}/v1/turnkv/stats").json()["engines"]
    assert [e["healthy"] for e in health if e["name"] == victim.spec.name] == [False]

    # The session's next turns leave the dead engine, and the stats say why.
    for turn in (2, 3):
        out = routed_chat(state.router, state.served_model_name, reference.messages[turn - 1],
                          MAX_TOKENS, session=session, stream=turn == 3, client=client)
        _assert_same(reference.turns[turn - 1], out, turn)
        assert out.stats["decode_node"] != victim.spec.name
        if turn == 2:
            assert out.stats["fallback"] == "engine_unavailable"
            assert victim.spec.name in out.stats["fallback_detail"]
            assert out.stats["moved"] is True
    record = client.get(f"{state.router}/v1/turnkv/sessions/failover").json()
    assert record["totals"]["fallbacks"] == 1
