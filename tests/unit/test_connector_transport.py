"""The transfer protocol between two real NIXL agents in one process (UCX over loopback): what
moves, and when. Failures are in `test_connector_transport_faults`, the side channel's
defences in `test_connector_side_channel`; the agents and helpers in `transfer_pair`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.unit.transfer_pair import (
    LAYERS,
    MODEL,
    PROMPT,
    SENT,
    Engine,
    Pair,
    engine_pair,
    registered,
    untouched,
    wait_until,
)
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.engine.nixl_poll import apply_poll_delay


@pytest.fixture
def pair() -> Iterator[Pair]:
    with engine_pair() as engines:
        yield engines


def test_the_sender_writes_exactly_the_registered_blocks(pair: Pair
                                                        ) -> None:
    sender, receiver, address = pair
    # The sender's request held blocks 0..4 (block i of its prompt); the receiver lacks
    # prompt blocks 2..4 and allocated its blocks 7, 1, 5 for them.
    receiver.receive("rx", "t1", address, [7, 1, 5], first_block=2)
    sender.send("tx", "t1", [0, 1, 2, 3, 4])
    wait_until(receiver.received("rx"))
    wait_until(sender.sent("tx"))
    for dest, source in ((7, 2), (1, 3), (5, 4)):
        assert torch.equal(receiver.buffer[:, dest], sender.buffer[:, source])
    assert untouched(receiver, but=(7, 1, 5))
    assert receiver.results.failed_blocks == set()
    assert receiver.results.counters.blocks_received == 3
    assert sender.results.counters.bytes_sent == 3 * LAYERS * 4 * 16 * 4


def test_registration_before_or_after_the_send_both_work(pair: Pair
                                                         ) -> None:
    sender, receiver, address = pair
    sender.send("tx", "t1", [3])
    time.sleep(0.1)
    receiver.receive("rx", "t1", address, [6], first_block=0)
    wait_until(receiver.received("rx"))
    assert torch.equal(receiver.buffer[:, 6], sender.buffer[:, 3])


def test_a_refused_or_short_transfer_fails_to_recompute(pair: Pair
                                                        ) -> None:
    sender, receiver, address = pair
    sender.agent.refuse("t1")
    receiver.receive("rx1", "t1", address, [1, 2], first_block=0)
    wait_until(receiver.received("rx1"))
    assert receiver.results.failed_blocks == {1, 2}
    # The sender holds two blocks; the receiver asks for three.
    receiver.receive("rx2", "t2", address, [3, 4, 5], first_block=0)
    sender.send("tx2", "t2", [0, 1])
    wait_until(receiver.received("rx2"))
    wait_until(sender.sent("tx2"))
    assert receiver.results.failed_blocks == {1, 2, 3, 4, 5}
    assert sender.results.counters.sends_failed == 1
    assert untouched(receiver)


def test_a_declined_transfer_lets_the_sender_go(pair: Pair) -> None:
    sender, receiver, address = pair
    receiver.agent.decline("t1", address)
    time.sleep(0.1)
    sender.send("tx", "t1", [0])
    wait_until(sender.sent("tx"))
    assert sender.results.counters.sends_failed == 0


def test_a_restarted_sender_gets_a_new_handshake(pair: Pair) -> None:
    sender, receiver, address = pair
    receiver.receive("rx1", "t1", address, [1], first_block=0)
    sender.send("tx1", "t1", [0])
    wait_until(receiver.received("rx1"))
    # The sender restarts on the same address: a new agent that has never met the receiver.
    sender.agent.close()
    port = int(address.rsplit(":", 1)[1])
    restarted = Engine("sender", fill=9.0, listen=True, port=port)
    try:
        receiver.receive("rx2", "t2", address, [2], first_block=0)
        restarted.send("tx2", "t2", [5])
        wait_until(receiver.received("rx2"))
        assert receiver.results.failed_blocks == set()
        assert bool((receiver.buffer[:, 2] == 9.0).all())
    finally:
        restarted.agent.close()


def test_an_abandoned_send_frees_its_blocks_and_fails_a_late_registration(
        pair: Pair) -> None:
    sender, receiver, address = pair
    sender.send("tx", "t1", [0, 1])
    sender.agent.abandon("t1")  # the sender's engine needs the blocks; nobody registered yet
    wait_until(sender.sent("tx"))
    counters = sender.results.counters
    assert (counters.sends_failed, counters.sends_abandoned) == (1, 1)
    receiver.receive("rx", "t1", address, [3, 4], first_block=0)
    wait_until(receiver.received("rx"))
    assert receiver.results.failed_blocks == {3, 4}
    assert untouched(receiver)


def test_layers_written_during_the_request_are_not_written_again(
        pair: Pair) -> None:
    sender, receiver, address = pair
    # The request's blocks are 0..4; the receiver lacks 2..4, into its blocks 7, 1, 5.
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [7, 1, 5], first_block=2)
    wait_until(registered(sender, "t1"))
    sender.agent.write_layer("t1", 0, [(0, 0), (1, 1), (2, 2), (3, 3)])  # 0, 1: not wanted
    sender.agent.write_layer("t1", 1, [(2, 2)])
    wait_until(lambda: bool((receiver.buffer[1, 7] == 3.0).all()))
    streamed = sender.buffer.clone()
    # Were blocks 2 and 3 rewritten at the end, these new bytes would show at the receiver.
    sender.buffer[:, 2:5] += 100.0
    sender.send("tx", "t1", [0, 1, 2, 3, 4])
    wait_until(receiver.received("rx"))
    wait_until(sender.sent("tx"))
    assert receiver.results.failed_blocks == set()
    assert torch.equal(receiver.buffer[0, 7], streamed[0, 2])   # layer 0, streamed
    assert torch.equal(receiver.buffer[0, 1], streamed[0, 3])
    assert torch.equal(receiver.buffer[1, 7], streamed[1, 2])   # layer 1, streamed
    assert torch.equal(receiver.buffer[1, 1], sender.buffer[1, 3])  # layer 1, at the end
    assert torch.equal(receiver.buffer[:, 5], sender.buffer[:, 4])  # both layers, at the end
    layer_block = 4 * 16 * 4
    counters = sender.results.counters
    assert counters.bytes_streamed == 3 * layer_block
    assert (counters.blocks_sent, counters.bytes_sent) == (3, 3 * LAYERS * layer_block)
    assert untouched(receiver, but=(7, 1, 5))


class KernelStillRunning:
    """A GPU layer's event: its kernel writes the layer's bytes when it completes, so a write
    posted before `synchronize` returned would carry the old bytes."""

    def __init__(self, engine: Engine, layer: int, block: int, value: float) -> None:
        self.engine, self.layer, self.block, self.value = engine, layer, block, value
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1
        self.engine.buffer[self.layer, self.block] = self.value


def test_a_layer_is_written_only_once_its_kernels_completed(pair: Pair) -> None:
    sender, receiver, address = pair
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6], first_block=1)
    wait_until(registered(sender, "t1"))
    unwanted = KernelStillRunning(sender, 0, 0, 50.0)
    sender.agent.write_layer("t1", 0, [(0, 0)], ready=unwanted)  # block 0: nobody asked
    layer_0 = KernelStillRunning(sender, 0, 1, 70.0)
    sender.agent.write_layer("t1", 0, [(1, 1)], ready=layer_0)
    wait_until(lambda: bool((receiver.buffer[0, 6] == 70.0).all()))
    # Layer 0 is not written again at the end: what arrived is what the kernel left.
    sender.buffer[0, 1] = 90.0
    sender.send("tx", "t1", [0, 1])
    wait_until(receiver.received("rx"))
    assert bool((receiver.buffer[0, 6] == 70.0).all())
    assert torch.equal(receiver.buffer[1, 6], sender.buffer[1, 1])
    assert (unwanted.waits, layer_0.waits) == (0, 1)
    assert untouched(receiver, but=(6,))


def test_a_fully_streamed_transfer_still_notifies(pair: Pair) -> None:
    sender, receiver, address = pair
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6, 2], first_block=0)
    wait_until(registered(sender, "t1"))
    for layer in range(LAYERS):
        sender.agent.write_layer("t1", layer, [(0, 3), (1, 4)])
    sender.send("tx", "t1", [3, 4])
    wait_until(receiver.received("rx"))
    assert receiver.results.failed_blocks == set()
    assert torch.equal(receiver.buffer[:, 6], sender.buffer[:, 3])
    assert torch.equal(receiver.buffer[:, 2], sender.buffer[:, 4])


def test_a_restarted_request_is_written_whole_at_the_end(pair: Pair
                                                         ) -> None:
    sender, receiver, address = pair
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6, 2], first_block=0)
    wait_until(registered(sender, "t1"))
    sender.agent.write_layer("t1", 0, [(0, 3), (1, 4)])
    # Preempted: its blocks may have been reused, so nothing streamed so far is trusted, nor
    # anything streamed after (an old write could land after a new one).
    sender.agent.write_layer("t1", 0, [], restart=True)
    sender.agent.write_layer("t1", 1, [(0, 3), (1, 4)])
    sender.buffer[:, 3:5] += 100.0
    sender.send("tx", "t1", [3, 4])
    wait_until(receiver.received("rx"))
    assert torch.equal(receiver.buffer[:, 6], sender.buffer[:, 3])
    assert torch.equal(receiver.buffer[:, 2], sender.buffer[:, 4])


# -- the same model and the same tokens on both sides ----------------------------------------------

def test_a_peer_of_another_model_or_dtype_is_refused(pair: Pair) -> None:
    sender, _, address = pair
    other = Engine("other", fill=-1.0, receive_timeout_s=1.0,
                   fingerprint=MODEL.with_fields({"dtype": "bfloat16"}))
    try:
        other.receive("rx", "t1", address, [1, 2], first_block=0)
        sender.send("tx", "t1", [0, 1])
        wait_until(other.received("rx"))
        assert other.results.failed_blocks == {1, 2}
        assert untouched(other)
        assert not sender.agent.writer.peers  # its NIXL metadata was never loaded
    finally:
        other.agent.close()


def test_a_registration_for_other_tokens_is_refused(pair: Pair) -> None:
    sender, receiver, address = pair
    # The receiver's history differs from the sender's at token 40 (another chat template,
    # say): the KV of blocks past it was computed for other tokens.
    edited = PROMPT[:40] + (7,) + PROMPT[41:]
    receiver.receive("rx", "t1", address, [1, 2], first_block=0, tokens=edited)
    sender.send("tx", "t1", [0, 1])
    wait_until(receiver.received("rx"))
    wait_until(sender.sent("tx"))
    assert receiver.results.failed_blocks == {1, 2}
    assert untouched(receiver)
    assert sender.results.counters.transfers_mismatched == 1
    # A prefix of the sender's tokens is fine: the receiver may need less than it holds.
    receiver.receive("rx2", "t2", address, [3], first_block=0, tokens=PROMPT[:16])
    sender.send("tx2", "t2", [0, 1])
    wait_until(receiver.received("rx2"))
    assert 3 not in receiver.results.failed_blocks


def test_a_registration_past_the_senders_computed_kv_is_refused(pair: Pair) -> None:
    """A finished request holds its prompt and the token it sampled last, whose KV vLLM never
    computed: a registration that covers that token asks for KV the sender does not have,
    though every token ID matches."""
    sender, receiver, address = pair
    receiver.receive("rx1", "t1", address, [1, 2, 3, 4, 5], first_block=0, tokens=SENT)
    sender.send("tx1", "t1", [0, 1, 2, 3, 4])
    wait_until(receiver.received("rx1"))
    assert receiver.results.failed_blocks == {1, 2, 3, 4, 5}
    # The same while the request still computes: its prompt does not cover the registration,
    # so the check waits for the finished request, and refuses then.
    sender.agent.expect("t2", PROMPT)
    receiver.receive("rx2", "t2", address, [6], first_block=4, tokens=SENT)
    wait_until(registered(sender, "t2"))
    sender.send("tx2", "t2", [0, 1, 2, 3, 4])
    wait_until(receiver.received("rx2"))
    assert receiver.results.failed_blocks == {1, 2, 3, 4, 5, 6}
    assert untouched(receiver)
    wait_until(lambda: {"tx1", "tx2"} <= sender.collect().finished_sending)
    assert sender.results.counters.sends_done == 0


# -- agents come and go; deadlines follow the work that is really pending --------------------------

def test_a_restarted_receiver_replaces_its_old_agent(pair: Pair) -> None:
    sender, receiver, address = pair
    receiver.receive("rx1", "t1", address, [1], first_block=0)
    sender.send("tx1", "t1", [0])
    wait_until(receiver.received("rx1"))
    assert len(sender.agent.writer.peers) == 1
    restarted = Engine("receiver", fill=-1.0)  # same engine, new process: a new agent name
    try:
        restarted.receive("rx2", "t2", address, [3], first_block=0)
        sender.send("tx2", "t2", [2])
        wait_until(restarted.received("rx2"))
        wait_until(lambda: list(sender.agent.writer.peers) == [restarted.agent.name])
    finally:
        restarted.agent.close()


def test_a_registration_after_the_send_timed_out_fails_at_once() -> None:
    apply_poll_delay()
    sender = Engine("sender", fill=1.0, listen=True, send_timeout_s=0.3)
    receiver = Engine("receiver", fill=-1.0, receive_timeout_s=60.0)
    try:
        sender.send("tx", "t1", [0])
        wait_until(sender.sent("tx"))  # nobody registered within its timeout
        receiver.receive("rx", "t1", sender.address, [1], first_block=0)
        wait_until(receiver.received("rx"), timeout=3.0)  # not after the receiver's 60 s
        assert receiver.results.failed_blocks == {1}
    finally:
        receiver.agent.close()
        sender.agent.close()


def test_a_queued_sender_request_is_waited_for(pair: Pair) -> None:
    sender, receiver, address = pair
    # The receive times out after 1 s, but the sender's request is known: it is queued.
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6], first_block=0)
    time.sleep(2.5)
    sender.send("tx", "t1", [2])
    wait_until(receiver.received("rx"))
    assert receiver.results.failed_blocks == set()
    assert torch.equal(receiver.buffer[:, 6], sender.buffer[:, 2])


def test_two_requests_under_one_transfer_id_move_kv_for_one_only(
        pair: Pair) -> None:
    """vLLM splits a request of several prompts into several requests with the same params:
    one transfer fills one request's blocks, the other request computes its own."""
    sender, receiver, address = pair
    receiver.receive("rx1", "t1", address, [1], first_block=0)
    receiver.receive("rx2", "t1", address, [2], first_block=0)
    wait_until(receiver.received("rx2"))
    assert receiver.results.failed_blocks == {2}
    sender.send("tx1", "t1", [4])
    sender.send("tx2", "t1", [5])
    wait_until(receiver.received("rx1"))
    wait_until(lambda: {"tx1", "tx2"} <= sender.collect().finished_sending)
    assert torch.equal(receiver.buffer[:, 1], sender.buffer[:, 4])
    assert receiver.results.failed_blocks == {2}
    assert untouched(receiver, but=(1,))


def test_a_send_abandoned_before_it_is_known_ends_at_once(pair: Pair
                                                          ) -> None:
    sender, receiver, address = pair
    sender.agent.abandon("t1")  # the router's abandon overtook the request
    receiver.receive("rx", "t1", address, [1], first_block=0, timeout_s=30.0)
    wait_until(receiver.received("rx"))
    sender.send("tx", "t1", [0])
    wait_until(sender.sent("tx"), timeout=1.0)  # not after the send timeout
    assert receiver.results.failed_blocks == {1}
    assert untouched(receiver)


# -- per-layer cost: one transfer's writes are checked oldest first --------------------------------

class CountingWriter:
    """What `InFlight.settle` reads of a `Writer`: states, counted; handles complete in order."""

    def __init__(self) -> None:
        self.done = 0  # handles below this number have completed
        self.checks = 0

    def state(self, handle: int) -> str:
        self.checks += 1
        return "DONE" if handle < self.done else "PROC"

    def release_or_keep(self, handle: int, peer: object) -> bool:
        return True


def test_settling_a_transfers_writes_is_linear_in_its_layers() -> None:
    from turnkv_server.connector.writes import InFlight, Peer

    layers, peer, writer = 64, Peer("p", "e", BlockTable(1, ((0, 1, 0),)), None), CountingWriter()
    writes = InFlight()
    # A prefill posts one write per layer; the thread polls between layers, and the writes
    # complete in order, a few layers behind.
    for layer in range(layers):
        writes.add(layer, peer)
        writer.done = max(0, layer - 3)
        writes.settle(writer)  # type: ignore[arg-type]
    writer.done = layers
    assert writes.settle(writer)  # type: ignore[arg-type]
    assert peer.in_flight == 0
    # Each handle is looked at once when it is done, plus one look per poll at the oldest
    # still running: not every handle at every poll (64 * 65 / 2 = 2,080 looks).
    assert writer.checks <= 2 * layers + 1


# -- an idle agent costs nothing ----------------------------------------------------------------

def _wakeups_by_thread() -> dict[int, int]:
    """Each of this process's threads' voluntary context switches: its wake-ups from sleep."""
    found = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    found[int(task.name)] = int(line.split()[1])
    return found


def test_an_idle_agents_threads_sleep() -> None:
    """An engine holding leases and moving nothing: none of the threads its agent started
    (the transfer thread, NIXL's progress thread, UCX's and ZeroMQ's) polls."""
    apply_poll_delay()
    before_start = _wakeups_by_thread()
    engine = Engine("idle", fill=0.0, listen=True)
    try:
        time.sleep(0.5)  # its start-up's own work done
        before = _wakeups_by_thread()
        time.sleep(1.0)
        after = _wakeups_by_thread()
        started = set(after) - set(before_start)
        assert started, "the agent started no threads"
        wakeups = sum(after[t] - before.get(t, 0) for t in started)
        assert wakeups <= 100, f"the idle agent's threads woke {wakeups} times in a second"
    finally:
        engine.agent.close()
