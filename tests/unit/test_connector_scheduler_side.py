"""The connector's scheduler half on vLLM's real block pool and requests: orders, leases, room."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request, RequestStatus

from turnkv_server.connector.identity import token_digest
from turnkv_server.connector.leases import LeaseLimits
from turnkv_server.connector.orders import ExpectOrder, ReceiveOrder, SendOrder, StreamOrder
from turnkv_server.connector.scheduler_side import SchedulerSide
from turnkv_server.engine.protocol import Receive, Send, TurnParams

BLOCKS = 32
BLOCK = 16
PEER = "127.0.0.1:7000"


def prompt(tokens: int) -> list[int]:
    return [1000 + i for i in range(tokens)]


def request(rid: str, tokens: int, **params: Any) -> Request:
    """A vLLM request for `tokens` prompt tokens carrying these turnkv params."""
    return raw_request(rid, tokens, {"turnkv": TurnParams(**params).to_wire()} if params else None)


def raw_request(rid: str, tokens: int, kv_transfer_params: dict[str, Any] | None,
                session_id: str | None = None) -> Request:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return Request(rid, prompt(tokens), SamplingParams(max_tokens=16, extra_args=extra), None,
                   session_id=session_id)


def setup(fraction: float = 1.0) -> tuple[BlockPool, SchedulerSide]:
    pool = BlockPool(num_gpu_blocks=BLOCKS, enable_caching=True, hash_block_size=BLOCK)
    side = SchedulerSide(BLOCK, LeaseLimits(max_pinned_fraction=fraction))
    side.bind(pool, BLOCKS)
    return pool, side


def allocate(pool: BlockPool, n: int) -> list[int]:
    return [b.block_id for b in pool.get_new_blocks(n)]


def finish(pool: BlockPool, side: SchedulerSide, req: Request, ids: list[int],
           status: RequestStatus = RequestStatus.FINISHED_STOPPED
           ) -> tuple[bool, dict[str, Any] | None]:
    """The request ends with `status`; its blocks are freed unless delay-freed, as vLLM does."""
    req.status = status
    result = side.request_finished(req, ids)
    if not result[0]:
        pool.free_blocks([pool.blocks[i] for i in reversed(ids)])
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
    # The order names the tokens the blocks will hold once received, from token 0: the
    # sender checks them against its own.
    assert orders.receives == [ReceiveOrder("r1", "t1", PEER, ids[2:5], 2, None, 70,
                                            token_digest(prompt(70)))]
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
    req.append_output_token_ids([7, 8])
    delay_free, reply = finish(pool, side, req, ids)
    assert delay_free is True
    assert reply == {"turnkv": {"held_blocks": 3, "local_tokens": 0, "received_tokens": 0,
                                "receive_failed": False}}
    # The send names every token of the request: the receiver's registration must match.
    assert side.build_orders().sends == [SendOrder("r1", "t1", ids, (*prompt(40), 7, 8))]
    # A send whose request never computed anything is refused, not waited for.
    empty = request("r2", 40, send=Send("t2"))
    side.on_new_request(empty)
    assert finish(pool, side, empty, []) == (False, {"turnkv": {
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


def test_room_is_made_from_the_session_expected_back_last() -> None:
    pool, side = setup()
    leases = side.holder.leases  # type: ignore[union-attr]
    for n, (session, hint) in enumerate((("soon", 2.0), ("later", 60.0), ("mid", 30.0))):
        req = request(f"r{n}", 160, session=session, next_turn_in_s=hint)
        side.on_new_request(req)
        finish(pool, side, req, allocate(pool, 10))
    assert leases.get("later").expected_back == pytest.approx(time.monotonic() + 60, abs=5)
    # The session back in a minute has its turn early: this request needs its lease now.
    back = request("r3", 170, session="later", next_turn_in_s=60.0)
    side.on_new_request(back)
    assert leases.get("later").expected_back <= time.monotonic()
    # Another session needs 9 blocks: the one expected back last (mid) goes, not the least
    # recently used (soon) nor the one whose turn is here.
    newcomer = request("r9", 128, session="new")
    side.on_new_request(newcomer)
    side.get_num_new_matched_tokens(newcomer, 0)
    assert sorted(leases) == ["later", "soon"]


def test_a_renew_only_request_renews_the_lease_and_holds_nothing_of_its_own() -> None:
    """A hint sent between turns (a long tool run ahead) reaches the engine as a one-token
    request: the session's lease takes the new TTL, priority and expected return, and keeps
    the turn's blocks; the request's own block is not held in their place."""
    pool, side = setup()
    leases = side.holder.leases  # type: ignore[union-attr]
    free = pool.get_num_free_blocks()
    turn = request("r1", 40, session="s", ttl_s=10, next_turn_in_s=2.0)
    side.on_new_request(turn)
    ids = allocate(pool, 3)
    finish(pool, side, turn, ids)
    hint = request("r2", 1, session="s", renew_only=True, ttl_s=90, priority=3,
                   next_turn_in_s=60.0)
    side.on_new_request(hint)
    now = time.monotonic()
    lease = leases.get("s")
    assert lease is not None and lease.blocks == tuple(ids)
    assert lease.expires_at == pytest.approx(now + 90, abs=5)
    assert lease.expected_back == pytest.approx(now + 60, abs=5)  # not "back now"
    assert lease.priority == 3
    side.get_num_new_matched_tokens(hint, 0)
    _, reply = finish(pool, side, hint, allocate(pool, 1))
    assert reply is not None and reply["turnkv"]["held_blocks"] == 0
    assert leases.get("s") == lease  # the turn's blocks, under the renewed terms
    assert pool.get_num_free_blocks() == free - 3
    stats = side.take_stats()
    assert stats["leases_renewed"] == 1 and stats["pinned_blocks"] == 3
    assert "lease_hits" not in stats  # a hint is no turn


def test_a_renew_only_request_without_a_live_lease_does_nothing() -> None:
    """No lease here (never held, released, expired): nothing is renewed or revived, and
    the request's block is not held either."""
    pool, side = setup()
    leases = side.holder.leases  # type: ignore[union-attr]
    free = pool.get_num_free_blocks()
    other = request("r0", 40, session="other")
    side.on_new_request(other)
    finish(pool, side, other, allocate(pool, 3))
    short = request("r1", 40, session="short", ttl_s=0.05)
    side.on_new_request(short)
    finish(pool, side, short, allocate(pool, 3))
    time.sleep(0.1)
    for n, session in enumerate(("never", "short")):
        hint = request(f"h{n}", 1, session=session, renew_only=True, next_turn_in_s=60.0)
        side.on_new_request(hint)
        side.get_num_new_matched_tokens(hint, 0)
        _, reply = finish(pool, side, hint, allocate(pool, 1))
        assert reply is not None and reply["turnkv"]["held_blocks"] == 0
    assert sorted(leases) == ["other"]
    assert pool.get_num_free_blocks() == free - 3
    assert side.take_stats()["renewals_missed"] == 2


def test_malformed_params_leave_the_request_alone() -> None:
    pool, side = setup()
    req = raw_request("r1", 40, {"turnkv": {"ttl_s": -1}})
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
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req, ids) == (False, None)
    orders = side.build_orders()
    assert orders.refusals == ["t2"] and orders.sends == []
    # The peer may still be writing into the blocks: the transport cancels the receive with it
    # and reports the request received (its blocks failed) once nothing can land there.
    assert orders.cancels == ["t1"]
    assert "s" not in side.holder.leases  # type: ignore[union-attr]
    # Once the receive has ended, a finished request is handled as usual.
    again = request("r2", 40, session="s", receive=Receive("t3", PEER))
    side.on_new_request(again)
    side.get_num_new_matched_tokens(again, 0)
    side.update_state_after_alloc(again, ids, 40)
    side.received({"r2"})
    again.status = RequestStatus.FINISHED_STOPPED
    assert side.request_finished(again, ids)[1] is not None
    assert "s" in side.holder.leases  # type: ignore[union-attr]


@pytest.mark.parametrize("aborted", [False, True], ids=["gave-up", "aborted"])
def test_a_quarantined_receive_keeps_its_blocks_from_every_request_until_settled(
        aborted: bool) -> None:
    """The worker gave the receive up while the sender might still write: vLLM frees the
    request's blocks (to compute its prompt in others, or because it was aborted), and none of
    them may reach another request until the worker says no write can land."""
    pool, side = setup()
    req = request("r1", 40, receive=Receive("t1", PEER))
    side.on_new_request(req)
    side.get_num_new_matched_tokens(req, 0)
    ids = allocate(pool, 3)
    side.update_state_after_alloc(req, ids, 40)
    free = pool.get_num_free_blocks()
    if aborted:
        req.status = RequestStatus.FINISHED_ABORTED
        assert side.request_finished(req, ids) == (False, None)
    side.received({"r1"}, set(), {"r1"})
    pool.free_blocks([pool.blocks[i] for i in reversed(ids)])  # vLLM, right after
    assert pool.get_num_free_blocks() == free
    taken = allocate(pool, pool.get_num_free_blocks())
    assert not set(taken) & set(ids)
    pool.free_blocks([pool.blocks[i] for i in taken])
    assert side.take_stats()["quarantined_blocks"] == 3
    if aborted:
        # An idle engine steps now and then to hear the worker settle the quarantine.
        assert not side.has_pending_push_work()
        time.sleep(1.05)
        assert side.has_pending_push_work()
        side.build_orders()
        assert not side.has_pending_push_work()
    side.settled({"r1"})
    assert pool.get_num_free_blocks() == free + 3
    assert side.take_stats()["quarantined_blocks"] == 0
    if not aborted:  # the reply says nothing arrived
        req.status = RequestStatus.FINISHED_STOPPED
        reply = side.request_finished(req, allocate(pool, 3))[1]
        assert reply is not None and reply["turnkv"]["receive_failed"] is True


def test_a_request_aborted_before_it_asked_for_its_kv_lets_the_sender_go() -> None:
    """Aborted while waiting (never allocated, never registered): the sender's finished
    request would keep its blocks for the whole send timeout if nobody told it."""
    pool, side = setup()
    req = request("r1", 40, receive=Receive("t1", PEER))
    side.on_new_request(req)
    req.status = RequestStatus.FINISHED_ABORTED
    assert side.request_finished(req, []) == (False, {"turnkv": {
        "held_blocks": 0, "local_tokens": 0, "received_tokens": 0, "receive_failed": False}})
    assert side.build_orders().declines == [("t1", PEER)]


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


def test_a_load_by_the_tier_below_is_timed_from_the_blocks_allocation() -> None:
    """A request that no receive of ours loads, reported loaded all the same (vLLM's
    offloading connector beside this one loaded it from the tier), says how long it took; one
    whose blocks nobody loaded says nothing."""
    pool, side = setup()
    restored, computed = request("r1", 40, session="s"), request("r2", 40, session="s2")
    blocks = {}
    for req in (restored, computed):
        side.on_new_request(req)
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)
        blocks[req.request_id] = allocate(pool, 3)
        side.update_state_after_alloc(req, blocks[req.request_id], 0)
    time.sleep(0.02)
    side.received({"r1"})
    reply = finish(pool, side, restored, blocks["r1"])[1]
    assert reply is not None and reply["turnkv"]["restore_ms"] >= 20
    reply = finish(pool, side, computed, blocks["r2"])[1]
    assert reply is not None and "restore_ms" not in reply["turnkv"]


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
    # Blocks 0..3 full, 4 holds 6 tokens; the router marks the prefill's send for streaming.
    req = request("r1", 70, session="s", send=Send("t1", stream=True))
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


def test_only_sends_marked_for_streaming_stream() -> None:
    _, side = setup()
    side.on_new_request(request("r1", 64, session="s"))
    side.scheduled("r1", [1, 2, 3, 4], True, 0, 64)
    side.scheduled("untracked", [5], True, 0, 16)
    # A decode engine's send back to prefill: its receiver registers only after it ends.
    side.on_new_request(request("r2", 64, session="s", send=Send("t2")))
    side.scheduled("r2", [6, 7, 8, 9], True, 0, 64)
    assert side.build_orders().streams == []


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_STOPPED,
                                    RequestStatus.FINISHED_LENGTH_CAPPED,
                                    RequestStatus.FINISHED_REPETITION])
def test_a_request_that_finished_normally_sends(status: RequestStatus) -> None:
    pool, side = setup()
    req = request("r1", 40, send=Send("t1"))
    side.on_new_request(req)
    ids = allocate(pool, 3)
    assert finish(pool, side, req, ids, status)[0] is True
    orders = side.build_orders()
    assert orders.sends == [SendOrder("r1", "t1", ids, tuple(prompt(40)))]
    assert orders.refusals == []


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED,
                                    RequestStatus.FINISHED_ERROR,
                                    RequestStatus.FINISHED_IGNORED])
def test_a_request_that_did_not_finish_normally_refuses_its_send(status: RequestStatus) -> None:
    pool, side = setup()
    # Aborted on a block boundary inside the prompt: vLLM hands over exactly the blocks it
    # computed, so a block count cannot tell that the prompt's last block is missing.
    req = request("r1", 40, session="s", send=Send("t1"))
    side.on_new_request(req)
    ids = allocate(pool, 2)
    assert finish(pool, side, req, ids, status)[0] is False  # nothing to keep for a send
    orders = side.build_orders()
    assert orders.sends == [] and orders.refusals == ["t1"]
    # The lease still holds what was computed: vLLM hashes only full computed blocks, so the
    # next turn can hit only KV of its own tokens.
    assert side.holder is not None and side.holder.leases.get("s") is not None


def test_a_sending_request_is_announced_with_its_prompt() -> None:
    _, side = setup()
    side.on_new_request(request("r1", 40, send=Send("t1")))
    side.on_new_request(request("r2", 40, session="s"))
    # The transport answers a registration that comes before the request ends, and checks
    # its tokens, from this.
    assert side.build_orders().expects == [ExpectOrder("t1", tuple(prompt(40)))]


def test_the_router_can_abandon_this_engines_sends() -> None:
    pool, side = setup()
    sender = request("r1", 40, send=Send("t1"))
    side.on_new_request(sender)
    finish(pool, side, sender, allocate(pool, 3))
    side.build_orders()
    # The push back will not come: a one-token request says so.
    side.on_new_request(request("r2", 1, abandon=("t1", "t0")))
    assert side.build_orders().abandons == ["t1", "t0"]
    # Room is short later: t1 is not abandoned twice.
    newcomer = request("r3", 30 * BLOCK)
    side.on_new_request(newcomer)
    side.get_num_new_matched_tokens(newcomer, 0)
    assert side.build_orders().abandons == []


def test_a_lease_shared_with_a_running_request_frees_nothing_and_says_so() -> None:
    pool, side = setup()
    first = request("r1", 5 * BLOCK, session="s")
    side.on_new_request(first)
    ids = allocate(pool, 5)
    finish(pool, side, first, ids)
    # The session's next turn runs on those blocks (a prefix hit) and fills the pool.
    pool.touch([pool.blocks[i] for i in ids])
    running = pool.get_new_blocks(pool.get_num_free_blocks())
    # It cannot grow. Dropping the lease gives no block back: vLLM must preempt, not wait.
    assert side.has_pending_block_frees() is False
    assert side.holder is not None and len(side.holder.leases) == 0
    assert pool.get_num_free_blocks() == 0
    pool.free_blocks(running)


def test_an_idle_engine_is_woken_when_a_lease_runs_out() -> None:
    pool, side = setup()
    woken = threading.Event()
    side.bind(pool, BLOCKS, wake=woken.set)
    start = pool.get_num_free_blocks()
    req = request("r1", 40, session="s", ttl_s=0.2)
    side.on_new_request(req)
    finish(pool, side, req, allocate(pool, 3))
    side.build_orders()
    assert side.has_pending_push_work() is False  # the engine may sleep on its input queue
    # vLLM's engine core sleeps until something arrives on its queue: at the lease's deadline
    # the connector's timer puts a wake-up there; the engine then steps once.
    assert woken.wait(10)
    assert side.has_pending_push_work() is True
    assert pool.get_num_free_blocks() == start - 3  # only the engine's thread frees blocks
    side.build_orders()
    assert pool.get_num_free_blocks() == start
    assert side.has_pending_push_work() is False
    side.close()


def test_a_new_lease_rearms_the_wake_up_earlier() -> None:
    pool, side = setup()
    wakes: list[float] = []
    side.bind(pool, BLOCKS, wake=lambda: wakes.append(time.monotonic()))
    long = request("r1", 40, session="long", ttl_s=60)
    side.on_new_request(long)
    finish(pool, side, long, allocate(pool, 3))
    begin = time.monotonic()
    short = request("r2", 40, session="short", ttl_s=0.2)
    side.on_new_request(short)
    finish(pool, side, short, allocate(pool, 3))
    deadline = time.monotonic() + 10
    while not wakes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wakes and wakes[0] - begin >= 0.2
    side.close()


def test_reset_prefix_cache_and_reset_cache_work_with_leases_present() -> None:
    pool, side = setup()
    for rid, session in (("r1", "a"), ("r2", "b")):
        req = request(rid, 40, session=session)
        side.on_new_request(req)
        finish(pool, side, req, allocate(pool, 3))
    # vLLM resets the prefix cache (weights updated, sleep) only when no block is in use:
    # leases go first, their KV belongs to the old cache anyway.
    assert pool.reset_prefix_cache() is True
    assert side.holder is not None and len(side.holder.leases) == 0
    assert pool.get_num_free_blocks() == BLOCKS - 1
    req = request("r3", 40, session="c")
    side.on_new_request(req)
    finish(pool, side, req, allocate(pool, 3))
    assert side.reset_cache() is True
    assert len(side.holder.leases) == 0 and pool.get_num_free_blocks() == BLOCKS - 1
    assert side.take_stats()["leases_released"] == 3


def test_a_send_abandoned_before_its_request_ends_is_refused_when_it_does() -> None:
    pool, side = setup()
    sender = request("r1", 40, send=Send("t1"))
    side.on_new_request(sender)
    # The router gives the send up while the request still runs here (its abandon overtook
    # the request's end): the request keeps no blocks for it once it ends.
    side.on_new_request(request("r2", 1, abandon=("t1",)))
    side.build_orders()
    assert finish(pool, side, sender, allocate(pool, 3))[0] is False
    orders = side.build_orders()
    assert orders.sends == [] and orders.refusals == ["t1"]


def test_a_send_abandoned_before_its_request_arrives_is_refused_when_it_ends() -> None:
    pool, side = setup()
    # The router's abandon overtook the prefill request itself (still in the API server).
    side.on_new_request(request("r0", 1, abandon=("t1",)))
    assert side.build_orders().abandons == ["t1"]  # the transport answers a registration
    sender = request("r1", 40, send=Send("t1"))
    side.on_new_request(sender)
    assert finish(pool, side, sender, allocate(pool, 3))[0] is False
    orders = side.build_orders()
    assert orders.sends == [] and orders.refusals == ["t1"]


def test_a_requests_own_lease_goes_too_when_other_leases_leave_too_little_room() -> None:
    """A lease never makes a request wait, its own session's included: a request whose prompt
    does not start with what its session's lease holds would otherwise wait behind it for
    ever, and every request queued behind it too."""

    def leases_of(blocks: int) -> tuple[BlockPool, SchedulerSide]:
        pool, side = setup()
        for n, session in enumerate(("other", "mine")):
            req = request(f"r{n}", blocks * BLOCK, session=session)
            side.on_new_request(req)
            finish(pool, side, req, allocate(pool, blocks))
        return pool, side

    def admit(side: SchedulerSide, blocks: int) -> None:
        head = request("r2", blocks * BLOCK, session="mine")
        side.on_new_request(head)
        side.get_num_new_matched_tokens(head, 0)  # its own lease holds no prefix of it

    # 17 blocks needed, 1 free, the other lease frees 15: its own lease goes too.
    pool, side = leases_of(15)
    admit(side, 17)
    assert len(side.holder.leases) == 0 and pool.get_num_free_blocks() >= 17  # type: ignore[union-attr]
    # 16 needed, 11 free, the other lease frees 10: room enough, its own stays.
    pool, side = leases_of(10)
    admit(side, 16)
    assert list(side.holder.leases) == ["mine"]  # type: ignore[union-attr]
    assert pool.get_num_free_blocks() >= 17


def test_room_counts_the_unheld_blocks_of_a_prefix_hit_as_taken_from_the_free_ones() -> None:
    """vLLM admits a waiting request only if its whole sequence fits, and the blocks of its
    prefix hit that nobody references are among the free blocks it takes. Counting only the
    blocks past the hit made a request whose prefix was a shared, unheld system prompt look
    as if it fitted while vLLM refused it, behind a lease that was never evicted."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)

    def hashed(rid: str, tokens: int, session: str) -> Request:
        params = {"turnkv": TurnParams(session=session).to_wire()}
        return Request(rid, prompt(tokens), SamplingParams(
            max_tokens=16, extra_args={"kv_transfer_params": params}), None,
            block_hasher=hasher)

    def cached(pool: BlockPool, req: Request, blocks: int) -> list[int]:
        got = pool.get_new_blocks(blocks)
        pool.cache_full_blocks(req, got, 0, blocks, BLOCK, 0)
        return [b.block_id for b in got]

    def scene(system_held: bool) -> tuple[BlockPool, SchedulerSide, Request]:
        """A 5-block system prompt, cached, held by session mine's lease or by nobody;
        session other's lease; then mine's next prompt of 15 blocks, which hits the 5."""
        pool, side = setup()
        system = hashed("sys", 5 * BLOCK, "mine")
        side.on_new_request(system)
        ids = cached(pool, system, 5)
        if system_held:
            finish(pool, side, system, ids)
        else:
            pool.free_blocks([pool.blocks[i] for i in reversed(ids)])
        other_blocks = 15 if system_held else 20  # 11 blocks free either way
        other = request("o", other_blocks * BLOCK, session="other")
        side.on_new_request(other)
        finish(pool, side, other, allocate(pool, other_blocks))
        head = hashed("head", 15 * BLOCK, "mine")
        side.on_new_request(head)
        side.get_num_new_matched_tokens(head, 5 * BLOCK)
        return pool, side, head

    # Unheld hit: 11 free blocks (the 5 cached among them) for 10 new blocks past the hit,
    # but admission takes all 15 (plus a spare): other's lease goes.
    pool, side, _ = scene(system_held=False)
    assert "other" not in side.holder.leases  # type: ignore[union-attr]
    assert pool.get_num_free_blocks() >= 16
    # Held hit (mine's own lease holds the 5): 11 free for the 10 past the hit and a spare;
    # admission adopts the held 5 without taking a free block: other's lease stays.
    pool, side, _ = scene(system_held=True)
    assert sorted(side.holder.leases) == ["mine", "other"]  # type: ignore[union-attr]
    assert pool.get_num_free_blocks() == 11


def test_a_step_that_schedules_nothing_while_a_request_lacks_blocks_ends_a_lease() -> None:
    """vLLM asks for room only before a new request's admission and when a running request
    cannot grow: a request whose KV arrived, waiting for the blocks of its last tokens, asks
    nothing, and behind a lease would wait for ever (every step empty). Each such step ends
    the least valuable lease; steps that compute something, whose requests all wait for their
    KV, or whose waiting request lacks no block (a tier's deferred lookup), end none."""
    pool, side = setup()
    for n, session in enumerate(("a", "b")):
        req = request(f"r{n}", 160, session=session)
        side.on_new_request(req)
        finish(pool, side, req, allocate(pool, 10))
    leases = side.holder.leases  # type: ignore[union-attr]
    stuck = request("r2", 180, session="c")
    side.on_new_request(stuck)
    allocate(pool, 11)  # its blocks, into which 176 tokens' KV is arriving
    stuck.num_computed_tokens = 176
    stuck.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    assert pool.get_num_free_blocks() == 0
    side.build_orders(scheduled_tokens=0)  # its KV is still arriving: nothing to do
    side.build_orders(scheduled_tokens=8)
    assert sorted(leases) == ["a", "b"]
    stuck.status = RequestStatus.WAITING  # arrived; now it waits for its 12th block
    side.build_orders(scheduled_tokens=8)  # something ran: not stuck
    assert sorted(leases) == ["a", "b"]
    side.build_orders(scheduled_tokens=0)
    assert sorted(leases) == ["b"]
    assert side.take_stats()["leases_stuck"] == 1
    # Its block is free now: if vLLM still schedules nothing, it is not for want of blocks.
    side.build_orders(scheduled_tokens=0)
    assert sorted(leases) == ["b"]
    finish(pool, side, stuck, [])  # gone: an empty step is an idle one
    side.build_orders(scheduled_tokens=0)
    assert sorted(leases) == ["b"]


def test_a_quarantine_made_in_an_idle_engines_last_step_wakes_it_to_be_heard() -> None:
    """A client aborts during a receive, and the engine has nothing else to do: the worker
    reports the quarantine in the output of the engine's last step, after that step's orders
    set the alarm. The alarm must be set again, or the engine sleeps on its queue with the
    blocks held until some other request arrives."""
    pool, side = setup()
    woken = threading.Event()
    side.bind(pool, BLOCKS, wake=woken.set)
    req = request("r1", 40, receive=Receive("t1", PEER))
    side.on_new_request(req)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, allocate(pool, 3), 40)
    side.build_orders()
    req.status = RequestStatus.FINISHED_ABORTED
    side.request_finished(req, [])
    side.build_orders()  # the last step: it cancels the receive
    side.received({"r1"}, set(), {"r1"})  # that step's output: quarantined
    assert side.has_pending_push_work() is False  # the engine sleeps...
    assert woken.wait(10)  # ...until the alarm wakes it to poll the worker
    assert side.has_pending_push_work() is True
    side.close()


def test_receives_are_declined_while_quarantined_blocks_are_over_their_cap() -> None:
    """Quarantined blocks cannot be handed back early (a late write would land in another
    request's KV), so their share of the cache is bounded by taking no new receive while they
    are over the cap: the request computes its prompt itself and the sender is told."""
    pool, side = setup()  # the default cap: a quarter of the cache, 7 of 31 blocks

    def receive(rid: str, blocks: int) -> tuple[Request, list[int]]:
        req = request(rid, blocks * BLOCK, receive=Receive(f"t-{rid}", PEER))
        side.on_new_request(req)
        matched = side.get_num_new_matched_tokens(req, 0)
        ids = allocate(pool, blocks)
        side.update_state_after_alloc(req, ids, matched[0])
        return req, ids

    first, ids = receive("r1", 8)
    assert side.build_orders().receives != []
    side.received({"r1"}, set(), {"r1"})  # given up while the sender might still write
    pool.free_blocks([pool.blocks[i] for i in reversed(ids)])
    assert side.holder is not None and side.holder.quarantined_blocks == 8
    second = request("r2", 40, receive=Receive("t-r2", PEER))
    side.on_new_request(second)
    assert side.get_num_new_matched_tokens(second, 0) == (0, False)
    side.update_state_after_alloc(second, allocate(pool, 3), 0)
    orders = side.build_orders()
    assert orders.receives == [] and orders.declines == [("t-r2", PEER)]
    assert side.take_stats()["receives_declined_quarantine"] == 1
    side.settled({"r1"})
    receive("r3", 3)
    assert len(side.build_orders().receives) == 1


def test_the_reply_counts_no_token_another_connector_or_a_trim_took() -> None:
    """The connector offered 40 tokens, but vLLM loaded none through it (the tier beside it
    under MultiConnector won the request, or vLLM's partial-tail rule kept a local hit):
    nothing was received."""
    pool, side = setup()
    req = request("r1", 40, receive=Receive("t1", PEER))
    side.on_new_request(req)
    assert side.get_num_new_matched_tokens(req, 0) == (40, True)
    ids = allocate(pool, 3)
    side.update_state_after_alloc(req, ids, 0)
    assert side.build_orders().declines == [("t1", PEER)]
    assert finish(pool, side, req, ids)[1] == {"turnkv": {
        "held_blocks": 0, "local_tokens": 0, "received_tokens": 0, "receive_failed": False}}


def turn_of(rid: str, tokens: int, **wire: Any) -> Request:
    """A request carrying these turnkv params as the router writes them."""
    return raw_request(rid, tokens, {"turnkv": wire})


def test_a_request_in_flight_when_its_session_is_released_holds_nothing() -> None:
    """DELETE reaches the engine while a prefetch (or an aborted push back) of the session
    still runs: when that request ends, its blocks must not re-create the released lease."""
    pool, side = setup()
    free = pool.get_num_free_blocks()
    prefetch = turn_of("p", 40, session="s", epoch=5, next_turn_in_s=1.0)
    side.on_new_request(prefetch)
    side.on_new_request(turn_of("rel", 1, session="s", epoch=5, release=True))
    finish(pool, side, prefetch, allocate(pool, 3), RequestStatus.FINISHED_ABORTED)
    assert "s" not in side.holder.leases  # type: ignore[union-attr]
    assert pool.get_num_free_blocks() == free
    # The session's next life (a new epoch) holds as ever.
    turn = turn_of("t", 40, session="s", epoch=6)
    side.on_new_request(turn)
    finish(pool, side, turn, allocate(pool, 3))
    assert "s" in side.holder.leases  # type: ignore[union-attr]


def test_a_request_of_a_released_session_arriving_late_holds_and_renews_nothing() -> None:
    """The release overtook a request of the same session (a push back or a hint between
    turns still in the API server): the request is older than the release, by its epoch."""
    pool, side = setup()
    first = turn_of("t1", 40, session="s", epoch=5)
    side.on_new_request(first)
    finish(pool, side, first, allocate(pool, 3))
    side.on_new_request(turn_of("rel", 1, session="s", epoch=5, release=True))
    assert "s" not in side.holder.leases  # type: ignore[union-attr]
    free = pool.get_num_free_blocks()
    push_back = turn_of("pb", 40, session="s", epoch=5)
    side.on_new_request(push_back)
    finish(pool, side, push_back, allocate(pool, 3))
    assert "s" not in side.holder.leases  # type: ignore[union-attr]
    assert pool.get_num_free_blocks() == free
    assert side.take_stats()["holds_stale"] == 1


def test_a_stale_release_leaves_the_sessions_next_life_alone() -> None:
    """A release of the session's previous life that reaches the engine after the next life's
    first turn has ended must not end that turn's lease."""
    pool, side = setup()
    turn = turn_of("t", 40, session="s", epoch=6)
    side.on_new_request(turn)
    finish(pool, side, turn, allocate(pool, 3))
    side.on_new_request(turn_of("rel", 1, session="s", epoch=5, release=True))
    assert "s" in side.holder.leases  # type: ignore[union-attr]
    # Nor does a hint of the earlier life renew it.
    lease = side.holder.leases.get("s")  # type: ignore[union-attr]
    side.on_new_request(turn_of("h", 1, session="s", epoch=5, renew_only=True, ttl_s=1.0))
    assert side.holder.leases.get("s") == lease  # type: ignore[union-attr]
    assert side.take_stats()["holds_stale"] == 1
    side.on_new_request(turn_of("rel2", 1, session="s", epoch=6, release=True))
    assert "s" not in side.holder.leases  # type: ignore[union-attr]


def test_a_load_by_the_tier_in_the_step_that_computes_waited_for_nothing() -> None:
    """A request scheduled with more tokens computed than its local hit and no receive of
    ours, with no load reported first: the tier beside this connector loaded them in the step
    that computes the rest (`tier.offloading_connector`), so its reply says it waited 0 ms."""
    pool, side = setup()
    loaded = request("r1", 40, session="s")
    side.on_new_request(loaded)
    assert side.get_num_new_matched_tokens(loaded, 0) == (0, False)
    ids = allocate(pool, 3)
    side.update_state_after_alloc(loaded, ids, 0)
    side.scheduled("r1", ids, True, computed_tokens=32, scheduled_tokens=8)
    reply = finish(pool, side, loaded, ids)[1]
    assert reply is not None and reply["turnkv"]["restore_ms"] == 0.0
