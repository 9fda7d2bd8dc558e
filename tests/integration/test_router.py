"""The session router on real clusters (tiny model, float32): one prefill, two decode engines,
in each serving mode.

Every turn is checked against a single engine's greedy output for the same conversation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.conversation import conversation
from tests.support.oracle import Completion, RoutedCompletion, compare, greedy_chat, routed_chat
from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState

TURNS = 5
EDITED_AT = 3  # the turn whose history rewrites turn 1's assistant message
EDIT = "Let me restate my first answer more briefly: crashes can lose buffered writes."
MAX_TOKENS = 24


@dataclass
class Reference:
    turns: list[Completion]
    edited_turn: Completion
    messages: list[list[dict[str, Any]]]  # the exact messages of each turn
    edited_messages: list[dict[str, Any]]



@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    config = ClusterConfig(mode="single", model=str(tiny_model), dtype="float32",
                           run_dir=tmp_path_factory.mktemp("single"))
    with Cluster(config) as state, httpx.Client(timeout=300) as client:
        replies: list[str] = []
        outputs: list[Completion] = []
        for turn in range(TURNS):
            messages = conversation(replies, TURNS)[turn]
            out = greedy_chat(state.router, state.served_model_name, messages, MAX_TOKENS,
                              client=client)
            outputs.append(out)
            replies.append(out.text)
        edited = conversation(replies, TURNS)[EDITED_AT - 1]
        edited[2] = {"role": "assistant", "content": EDIT}
        edited_out = greedy_chat(state.router, state.served_model_name, edited, MAX_TOKENS,
                                 client=client)
    return Reference(outputs, edited_out, conversation(replies, TURNS), edited)


@pytest.fixture(scope="module", params=["turnkv", "standard", "bidirectional", "push"])
def cluster(
    request: pytest.FixtureRequest, reference: Reference, tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Cluster, ClusterState]]:
    # Health probes off after start: the failover test then meets the dead engine itself.
    config = ClusterConfig(mode=request.param, model=str(tiny_model), dtype="float32",
                           num_prefill=1, num_decode=2,
                           run_dir=tmp_path_factory.mktemp(request.param),
                           router_args=("--health-interval", "3600"),
                           # Read back however few tokens are missing: exact stats to assert.
                           kv_recompute_threshold=0)
    cluster = Cluster(config)
    with cluster as state:
        yield cluster, state


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as c:
        yield c


def _assert_same(ref: Completion, out: RoutedCompletion, turn: int) -> None:
    verdict = compare(ref, out.completion)
    print(f"turn {turn}: {verdict.describe()}; stats {out.stats['prompt_tokens']}")
    assert verdict.acceptable, f"turn {turn}: {verdict.describe()}"


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


def test_session_api_and_bad_input(cluster: tuple[Cluster, ClusterState],
                                   client: httpx.Client) -> None:
    _, state = cluster
    url = f"{state.router}/v1/turnkv/sessions"
    assert client.get(f"{url}/five-json").json()["turns"] == TURNS
    renewed = client.post(f"{url}/five-json/hints", json={"ttl": 5, "priority": 3}).json()
    assert 0 < renewed["expires_in_s"] <= 5 and renewed["priority"] == 3
    bad = client.post(f"{url}/five-json/hints", json={"ttl": -1})
    assert bad.status_code == 400 and "ttl" in bad.json()["error"]["message"]
    assert client.delete(f"{url}/five-json").json()["released"] is True
    assert client.get(f"{url}/five-json").status_code == 404
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


def test_a_killed_decode_engine_falls_back_to_the_other_pair(
    reference: Reference, cluster: tuple[Cluster, ClusterState], client: httpx.Client
) -> None:
    launched, state = cluster
    session = {"session_id": "failover"}
    first = routed_chat(state.router, state.served_model_name, reference.messages[0],
                        MAX_TOKENS, session=session, stream=False, client=client)
    _assert_same(reference.turns[0], first, 1)
    victim = next(e for e in launched.engines if e.spec.name == first.stats["decode_node"])
    victim.stop()  # the whole process group, as a crash would leave it

    # The round robin sends one of two turns to the dead engine: both are answered.
    for _ in range(2):
        plain = routed_chat(state.router, state.served_model_name, reference.messages[0],
                            MAX_TOKENS, session=None, stream=False, client=client)
        _assert_same(reference.turns[0], plain, 1)
    metrics = client.get(f"{state.router}/metrics").text
    assert 'turnkv_fallbacks_total{reason="engine_unavailable"} 1.0' in metrics
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
