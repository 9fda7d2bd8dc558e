"""The connector's scheduler half on vLLM's real block pool: orders, leases and room."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.core.block_pool import BlockPool

from turnkv_server.connector.leases import LeasePolicy
from turnkv_server.connector.params import Receive, Send, TurnParams
from turnkv_server.connector.scheduler_side import (
    ReceiveOrder,
    SchedulerSide,
    SendOrder,
    StreamOrder,
)

BLOCKS = 32
BLOCK = 16
PEER = "127.0.0.1:7000"


@dataclass
class Request:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    num_prompt_tokens: int
    num_tokens: int


def request(rid: str, tokens: int, **params: Any) -> Request:
    wire = {"turnkv": TurnParams(**params).to_wire()} if params else None
    return Request(rid, wire, tokens, tokens)


def setup(fraction: float = 1.0) -> tuple[BlockPool, SchedulerSide]:
    pool = BlockPool(num_gpu_blocks=BLOCKS, enable_caching=True, hash_block_size=BLOCK)
    side = SchedulerSide(BLOCK, LeasePolicy(max_pinned_fraction=fraction))
    side.bind(pool, BLOCKS)
    return pool, side


def allocate(pool: BlockPool, n: int) -> list[int]:
    return [b.block_id for b in pool.get_new_blocks(n)]


def finish(pool: BlockPool, side: SchedulerSide, req: Request, ids: list[int]
           ) -> tuple[bool, dict[str, Any] | None]:
    result = side.request_finished(req, ids)
    if not result[0]:
        pool.free_blocks([pool.blocks[i] for i in reversed(ids)])  # what vLLM then does
    return result


def test_a_receive_registers_only_the_blocks_past_the_local_hit() -> None:
    pool, side = setup()
    req = request("r1", 70, session="s", receive=Receive("t1", PEER))
    side.on_new_request(req)
    # 32 tokens (2 blocks) hit locally; the peer holds the whole prompt.
    assert side.get_num_new_matched_tokens(req, 32) == (38, True)
    assert side.get_num_new_matched_tokens(req, 32) == (38, True)  # asked again: same answer
    ids = allocate(pool, 5)
    side.update_state_after_alloc(req, ids, 38)
    orders = side.build_orders()
    assert orders.receives == [ReceiveOrder("r1", "t1", PEER, ids[2:5], 2)]
    # Once registered, a preempted request recomputes instead of asking twice.
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.take_stats()["tokens_requested"] == 38


def test_peer_tokens_limit_the_receive_and_nothing_missing_declines() -> None:
    pool, side = setup()
    req = request("r1", 70, receive=Receive("t1", PEER, peer_tokens=50))
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 32) == (18, True)
    full = request("r2", 40, receive=Receive("t2", PEER, peer_tokens=30))
    side.on_new_request(full)
    assert side.get_num_new_matched_tokens(full, 32) == (0, False)
    side.update_state_after_alloc(full, allocate(pool, 3), 0)
    assert side.build_orders().declines == [("t2", PEER)]


def test_a_sender_keeps_its_blocks_until_written_and_holds_them_for_the_session() -> None:
    pool, side = setup()
    req = request("r1", 40, session="s", send=Send("t1"))
    side.on_new_request(req)
    ids = allocate(pool, 3)
    delay_free, reply = side.request_finished(req, ids)
    assert delay_free is True
    assert reply == {"turnkv": {"held_blocks": 3, "local_tokens": 0, "received_tokens": 0,
                                "receive_failed": False}}
    assert side.build_orders().sends == [SendOrder("r1", "t1", ids)]
    # A send whose request never computed anything is refused, not waited for.
    empty = request("r2", 40, send=Send("t2"))
    side.on_new_request(empty)
    assert side.request_finished(empty, []) == (False, {"turnkv": {
        "held_blocks": 0, "local_tokens": 0, "received_tokens": 0, "receive_failed": False}})
    assert side.build_orders().refusals == ["t2"]


def test_leases_are_hit_renewed_and_released() -> None:
    pool, side = setup()
    free = pool.get_num_free_blocks()
    first = request("r1", 40, session="s")
    side.on_new_request(first)
    finish(pool, side, first, allocate(pool, 3))
    assert pool.get_num_free_blocks() == free - 3  # held after the request
    second = request("r2", 60, session="s")
    side.on_new_request(second)
    finish(pool, side, second, allocate(pool, 4))
    last = request("r3", 1, session="s", release=True)
    side.on_new_request(last)
    finish(pool, side, last, allocate(pool, 1))
    assert pool.get_num_free_blocks() == free
    stats = side.take_stats()
    assert stats["lease_misses"] == 1 and stats["lease_hits"] == 1
    assert stats["leases_released"] == 1 and stats["pinned_blocks"] == 0


def test_room_is_made_for_a_waiting_request_and_a_growing_one() -> None:
    pool, side = setup()
    for n, session in enumerate(("a", "b", "c")):
        req = request(f"r{n}", 160, session=session)
        side.on_new_request(req)
        finish(pool, side, req, allocate(pool, 10))
    assert pool.get_num_free_blocks() == BLOCKS - 1 - 30
    # A new request of session c needs 8 blocks: the oldest leases go, c's own stays.
    newcomer = request("r9", 128, session="c")
    side.on_new_request(newcomer)
    side.get_num_new_matched_tokens(newcomer, 0)
    assert pool.get_num_free_blocks() >= 8
    assert "c" in side.holder.leases and "a" not in side.holder.leases  # type: ignore[union-attr]
    # A running request that cannot grow frees one more lease; with none left, nothing.
    while side.has_pending_block_frees():
        pass
    assert len(side.holder.leases) == 0  # type: ignore[union-attr]
    assert side.has_pending_block_frees() is False
    assert pool.get_num_free_blocks() == BLOCKS - 1


def test_malformed_params_leave_the_request_alone() -> None:
    pool, side = setup()
    req = Request("r1", {"turnkv": {"ttl_s": -1}}, 40, 40)
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert finish(pool, side, req, allocate(pool, 3)) == (False, None)


def test_a_request_aborted_while_receiving_neither_holds_nor_sends() -> None:
    pool, side = setup()
    req = request("r1", 40, session="s", receive=Receive("t1", PEER), send=Send("t2"))
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (40, True)
    ids = allocate(pool, 3)
    side.update_state_after_alloc(req, ids, 40)
    assert side.request_finished(req, ids) == (False, None)
    orders = side.build_orders()
    assert orders.refusals == ["t2"] and orders.sends == []
    assert "s" not in side.holder.leases  # type: ignore[union-attr]
    # Once the receive has ended, a finished request is handled as usual.
    again = request("r2", 40, session="s", receive=Receive("t3", PEER))
    side.on_new_request(again)
    side.get_num_new_matched_tokens(again, 0)
    side.update_state_after_alloc(again, ids, 40)
    side.received({"r2"})
    assert side.request_finished(again, ids)[1] is not None
    assert "s" in side.holder.leases  # type: ignore[union-attr]


def test_the_reply_says_what_arrived_and_what_failed() -> None:
    pool, side = setup()
    good = request("r1", 40, receive=Receive("t1", PEER))
    bad = request("r2", 40, receive=Receive("t2", PEER))
    blocks = {}
    for req in (good, bad):
        side.on_new_request(req)
        side.get_num_new_matched_tokens(req, 16)
        blocks[req.request_id] = allocate(pool, 3)
        side.update_state_after_alloc(req, blocks[req.request_id], 24)
    # One step reports both done; one of r2's blocks failed to load (vLLM recomputes it).
    side.received({"r1", "r2"}, failed_blocks={blocks["r2"][2]})
    assert finish(pool, side, good, blocks["r1"])[1] == {"turnkv": {
        "held_blocks": 0, "local_tokens": 16, "received_tokens": 24, "receive_failed": False}}
    assert finish(pool, side, bad, blocks["r2"])[1] == {"turnkv": {
        "held_blocks": 0, "local_tokens": 16, "received_tokens": 0, "receive_failed": True}}


def test_sends_nobody_registered_for_are_abandoned_when_leases_are_not_enough() -> None:
    pool, side = setup()
    senders = [request(f"s{n}", 160, send=Send(f"t{n}")) for n in range(3)]
    held = []
    for req in senders:
        side.on_new_request(req)
        held.append(allocate(pool, 10))
        assert finish(pool, side, req, held[-1])[0] is True  # delay-freed
    side.build_orders()
    side.sent({"s0"})  # s0 was written and freed: only s1 and s2 are still waiting
    pool.free_blocks([pool.blocks[i] for i in held[0]])
    # A waiting request needs 20 blocks and there are no leases: the oldest waiting send goes.
    newcomer = request("r9", 19 * BLOCK)
    side.on_new_request(newcomer)
    side.get_num_new_matched_tokens(newcomer, 0)
    assert side.build_orders().abandons == ["t1"]
    side.get_num_new_matched_tokens(newcomer, 0)  # asked again before the worker acted
    assert side.build_orders().abandons == []


def test_a_sending_request_names_the_blocks_each_step_completes() -> None:
    _, side = setup()
    req = request("r1", 70, session="s", send=Send("t1"))  # blocks 0..3 full, 4 holds 6 tokens
    side.on_new_request(req)
    # Step 1: tokens 10..40 of a prompt whose first 10 hit the cache; completes blocks 0 and 1.
    side.scheduled("r1", [20, 21, 22], True, 10, 30)
    # Step 2: tokens 40..70, with two more blocks; completes 2, 3 and the prompt's last block.
    side.scheduled("r1", [23, 24], False, 40, 30)
    # Decoding: nothing more to stream.
    side.scheduled("r1", [], False, 70, 1)
    assert side.build_orders().streams == [
        StreamOrder("t1", [(0, 20), (1, 21)]),
        StreamOrder("t1", [(2, 22), (3, 23), (4, 24)]),
    ]
    # Preempted and resumed: new blocks, and the worker is told to distrust what it wrote.
    side.scheduled("r1", [30, 31, 32, 33, 34], True, 0, 70)
    assert side.build_orders().streams == [
        StreamOrder("t1", [(0, 30), (1, 31), (2, 32), (3, 33), (4, 34)], restart=True)]


def test_only_sending_requests_stream() -> None:
    _, side = setup()
    side.on_new_request(request("r1", 64, session="s"))
    side.scheduled("r1", [1, 2, 3, 4], True, 0, 64)
    side.scheduled("untracked", [5], True, 0, 16)
    assert side.build_orders().streams == []
