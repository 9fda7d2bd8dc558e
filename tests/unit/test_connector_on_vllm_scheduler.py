"""The connector's scheduler half inside vLLM's own scheduler (`engine_scheduler`): what vLLM's
admission, running loop and async loads make of its room, leases and replies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.v1.outputs import KVConnectorOutput

from tests.unit.engine_scheduler import BLOCK, DeferredTier, EngineScheduler
from turnkv_server.engine.protocol import Receive

PEER = "127.0.0.1:7000"


def tokens(start: int, blocks: int) -> list[int]:
    """A prompt of whole blocks no other prompt of the test shares."""
    return list(range(start, start + blocks * BLOCK))


def hold_leases(engine: EngineScheduler, sessions: int, blocks: int) -> None:
    """`sessions` finished turns, each leaving a lease of `blocks` blocks."""
    for n in range(sessions):
        rid = f"lease-{n}"
        engine.add(rid, tokens(1000 * (n + 1), blocks), session=f"s{n}")
        engine.run_until_finished(rid)
    assert len(engine.turnkv.holder.leases) == sessions  # type: ignore[union-attr]


@pytest.fixture
def deferred_tier() -> Iterator[None]:
    DeferredTier.deferring = False
    yield
    DeferredTier.deferring = False


def test_a_deferred_tier_lookup_ends_no_lease(tmp_path: Path, deferred_tier: None) -> None:
    """While the tier below turnkv answers "ask again later", vLLM skips the request and the
    step schedules nothing: the request lacks no block, so no lease may go for it."""
    engine = EngineScheduler(tmp_path, blocks=32, tier=True)
    hold_leases(engine, sessions=3, blocks=5)  # 15 held, 16 free
    DeferredTier.deferring = True
    engine.add("w", tokens(90_000, 4), session="w")
    for _ in range(20):
        assert engine.step().total_num_scheduled_tokens == 0
    assert len(engine.turnkv.holder.leases) == 3  # type: ignore[union-attr]
    DeferredTier.deferring = False
    assert "w" in engine.step().num_scheduled_tokens
    assert {"s0", "s1", "s2"} <= set(engine.turnkv.holder.leases)  # type: ignore[union-attr]


def test_a_running_request_that_cannot_grow_starves_no_other(tmp_path: Path) -> None:
    """vLLM ends its whole running loop for the step once the connector says blocks are on
    their way back (`has_pending_block_frees`): every request after the one that could not
    grow would skip the step. Free blocks are kept at least one per running request, so no
    request meets an empty pool when it needs its next block."""
    engine = EngineScheduler(tmp_path, blocks=32)
    hold_leases(engine, sessions=5, blocks=5)  # 25 held, 6 free
    running = [f"r{n}" for n in range(4)]
    for n, rid in enumerate(running):
        engine.add(rid, tokens(50_000 + 1000 * n, 1), max_tokens=40)
    for step in range(40):
        scheduled = engine.step().num_scheduled_tokens
        alive = [rid for rid in running if rid in engine.scheduler.requests]
        if not alive:
            break
        assert set(alive) <= set(scheduled), f"step {step}: {sorted(scheduled)} of {alive}"
    assert not any(rid in engine.scheduler.requests for rid in running)


def test_a_receive_counts_only_the_tokens_vllm_kept(tmp_path: Path) -> None:
    """A prompt received whole: vLLM computes its last token again (the next token is sampled
    from it), so the peer's KV served every token but that one."""
    engine = EngineScheduler(tmp_path, blocks=32)
    prompt = tokens(70_000, 5)
    engine.add("r", prompt, receive=Receive("t1", PEER))
    output = engine.step()
    assert output.total_num_scheduled_tokens == 0  # waiting for its KV
    engine.step(kv=KVConnectorOutput(finished_recving={"r"}))
    engine.run_until_finished("r")
    reply = engine.replies["r"]
    assert reply is not None
    assert reply["turnkv"]["received_tokens"] == len(prompt) - 1
    assert reply["turnkv"]["local_tokens"] == 0
