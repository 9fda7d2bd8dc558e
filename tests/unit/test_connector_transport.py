"""The transfer protocol between two real NIXL agents in one process (UCX over loopback).

Each agent owns a small CPU "KV cache"; the receiver registers blocks, the sender writes its
own blocks into them. Failures end both sides: the receiver reports its blocks for recompute
once no write of the sender can still land in them, or, when it cannot know that, quarantines
them (its request recomputes elsewhere) until it can.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq

from turnkv_server.connector import receiving, sending
from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.identity import Fingerprint, token_digest
from turnkv_server.connector.transport import TransferAgent, TransferResults
from turnkv_server.engine.nixl_poll import apply_poll_delay

BLOCKS, LAYERS = 8, 2
SECRET = b"cluster-secret"
MODEL = Fingerprint.of({"model": "tiny", "dtype": "float32", "block_size": 16})
# The sending request's tokens; a receiver asks for the KV of a prefix of them.
PROMPT = tuple(range(1000, 1064))


class Engine:
    """An agent over its own cache: LAYERS layers of [BLOCKS, 4, 16] float32."""

    def __init__(self, name: str, fill: float, *, listen: bool = False, port: int = 0,
                 secret: bytes = SECRET, fingerprint: Fingerprint = MODEL,
                 **timeouts: float) -> None:
        self.buffer = torch.full((LAYERS, BLOCKS, 4, 16), fill)
        layers = list(self.buffer.unbind(0))
        self.agent = TransferAgent(name, BlockTable.from_layers(layers, BLOCKS),
                                   ("127.0.0.1", port) if listen else None, **timeouts,
                                   secret=secret, fingerprint=fingerprint)
        storage = self.buffer.untyped_storage()
        self.agent.register_memory([(storage.data_ptr(), storage.nbytes())])
        self.agent.start()
        self.results = TransferResults()

    @property
    def address(self) -> str:
        assert self.agent.address is not None
        return self.agent.address

    def receive(self, request_id: str, transfer_id: str, peer: str, blocks: list[int],
                first_block: int, tokens: tuple[int, ...] = PROMPT,
                timeout_s: float | None = None) -> None:
        self.agent.receive(request_id, transfer_id, peer, blocks, first_block, timeout_s,
                           tokens=len(tokens), digest=token_digest(tokens))

    def send(self, request_id: str, transfer_id: str, blocks: list[int],
             tokens: tuple[int, ...] = PROMPT) -> None:
        self.agent.send(request_id, transfer_id, blocks, tokens)

    def collect(self) -> TransferResults:
        new = self.agent.take_results()
        self.results.finished_sending |= new.finished_sending
        self.results.finished_recving |= new.finished_recving
        self.results.failed_blocks |= new.failed_blocks
        self.results.quarantined |= new.quarantined
        self.results.settled |= new.settled
        self.results.counters.add(new.counters)
        return self.results

    def received(self, request_id: str) -> Callable[[], bool]:
        return lambda: request_id in self.collect().finished_recving

    def sent(self, request_id: str) -> Callable[[], bool]:
        return lambda: request_id in self.collect().finished_sending

    def settled(self, request_id: str) -> Callable[[], bool]:
        return lambda: request_id in self.collect().settled


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def holds_for(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether `condition` stays true for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not condition():
            return False
        time.sleep(0.02)
    return True


def registered(engine: Engine, transfer_id: str) -> Callable[[], bool]:
    # The sender's thread owns its registrations; reading one attribute is enough here.
    def check() -> bool:
        out = engine.agent.sending.transfers.get(transfer_id)
        return out is not None and out.reg is not None
    return check


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine, str]]:
    apply_poll_delay()
    sender = Engine("sender", fill=0.0, listen=True, send_timeout_s=3.0)
    receiver = Engine("receiver", fill=-1.0, receive_timeout_s=1.0)
    for b in range(BLOCKS):
        sender.buffer[:, b] = b + 1.0  # every byte of block b says b + 1
    yield sender, receiver, sender.address
    receiver.agent.close()
    sender.agent.close()


def untouched(engine: Engine, but: tuple[int, ...] = ()) -> bool:
    rest = [b for b in range(BLOCKS) if b not in but]
    return bool((engine.buffer[:, rest] == -1.0).all())


def test_the_sender_writes_exactly_the_registered_blocks(pair: tuple[Engine, Engine, str]
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


def test_registration_before_or_after_the_send_both_work(pair: tuple[Engine, Engine, str]
                                                         ) -> None:
    sender, receiver, address = pair
    sender.send("tx", "t1", [3])
    time.sleep(0.1)
    receiver.receive("rx", "t1", address, [6], first_block=0)
    wait_until(receiver.received("rx"))
    assert torch.equal(receiver.buffer[:, 6], sender.buffer[:, 3])


def test_a_refused_or_short_transfer_fails_to_recompute(pair: tuple[Engine, Engine, str]
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


def test_a_silent_peer_times_out(pair: tuple[Engine, Engine, str]) -> None:
    _, receiver, _ = pair
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{unused.getsockname()[1]}"
    receiver.receive("rx", "t1", dead, [2], first_block=0)
    wait_until(receiver.received("rx"), timeout=5)
    assert receiver.results.failed_blocks == {2}
    assert receiver.results.counters.receives_failed == 1


def test_a_declined_transfer_lets_the_sender_go(pair: tuple[Engine, Engine, str]) -> None:
    sender, receiver, address = pair
    receiver.agent.decline("t1", address)
    time.sleep(0.1)
    sender.send("tx", "t1", [0])
    wait_until(sender.sent("tx"))
    assert sender.results.counters.sends_failed == 0


def test_a_restarted_sender_gets_a_new_handshake(pair: tuple[Engine, Engine, str]) -> None:
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


def test_a_sender_restarted_mid_transfer_settles_the_quarantine_after_the_grace(
        pair: tuple[Engine, Engine, str], monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sc, "WRITE_GRACE_S", 0.3)
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [1], first_block=0, timeout_s=30.0)
    wait_until(registered(sender, "t1"))
    sender.agent.close()
    wait_until(receiver.received("rx"), timeout=3.0)
    assert receiver.results.quarantined == {"rx"}
    # Another agent answers at its address: the old process is gone and the network works,
    # so what its connection still carried lands within the grace.
    port = int(address.rsplit(":", 1)[1])
    restarted = Engine("sender", fill=9.0, listen=True, port=port)
    try:
        receiver.receive("rx2", "t2", address, [2], first_block=0)
        restarted.send("tx2", "t2", [5])
        wait_until(receiver.received("rx2"))
        wait_until(receiver.settled("rx"))
        assert receiver.results.counters.quarantines_expired == 0
        assert bool((receiver.buffer[:, 2] == 9.0).all())
    finally:
        restarted.agent.close()


def test_an_abandoned_send_frees_its_blocks_and_fails_a_late_registration(
        pair: tuple[Engine, Engine, str]) -> None:
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
        pair: tuple[Engine, Engine, str]) -> None:
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


def test_a_fully_streamed_transfer_still_notifies(pair: tuple[Engine, Engine, str]) -> None:
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


def test_a_restarted_request_is_written_whole_at_the_end(pair: tuple[Engine, Engine, str]
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


# -- issue 15, item 2: the same model and the same tokens on both sides ------------------------

def test_a_peer_of_another_model_or_dtype_is_refused(pair: tuple[Engine, Engine, str]) -> None:
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


def test_a_registration_for_other_tokens_is_refused(pair: tuple[Engine, Engine, str]) -> None:
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


# -- item 3: a receiver hands its blocks back only when no write can still land -------------------

class SilentSender:
    """A sender that answers the hello, takes the registration, then goes silent: a stopped
    or wedged engine whose socket is still open. Speaks the real, signed protocol."""

    def __init__(self) -> None:
        self.codec = sc.Codec(SECRET)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"127.0.0.1:{port}"
        self.seen: list[Any] = []

    def serve_until_registered(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.socket.poll(50):
                continue
            identity, *frames = self.socket.recv_multipart()
            message = self.codec.decode(frames)
            self.seen.append(message)
            if isinstance(message, sc.Hello):
                self.socket.send_multipart(
                    [identity, *self.codec.encode(sc.HelloOk(agent="silent-sender"))])
            elif isinstance(message, sc.Register):
                return
        raise AssertionError("no registration")

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def test_a_receiver_that_gives_up_on_a_silent_sender_quarantines_its_blocks(
        pair: tuple[Engine, Engine, str], monkeypatch: pytest.MonkeyPatch) -> None:
    _, receiver, _ = pair
    monkeypatch.setattr(receiving, "QUARANTINE_MAX_S", 3.0)
    silent = SilentSender()
    try:
        receiver.receive("rx", "t1", silent.address, [1, 2], first_block=0, timeout_s=0.5)
        silent.serve_until_registered()
        # The receive's deadline passes. The sender could still be about to write (it is only
        # slow, or cut off): its request goes on without these blocks, which stay held.
        wait_until(receiver.received("rx"), timeout=5)
        assert receiver.results.quarantined == {"rx"} and not receiver.results.failed_blocks
        assert receiver.results.counters.receives_cancelled == 1
        # Its socket closing says nothing certain (a broken link looks the same): still held.
        silent.close()
        assert holds_for(lambda: "rx" not in receiver.collect().settled, 1.0)
        # No word from it for the longest a TCP connection retransmits: the blocks go back.
        wait_until(receiver.settled("rx"), timeout=5)
        assert receiver.results.counters.quarantines_expired == 1
    finally:
        silent.close()


class GatedStates:
    """The sender's NIXL agent, with transfers reported in flight until the gate opens: a
    slow link, on a machine where loopback writes complete at once."""

    def __init__(self, nixl: Any) -> None:
        self._nixl = nixl
        self.open = False

    def check_xfer_state(self, handle: Any) -> str:
        state = str(self._nixl.check_xfer_state(handle))
        return state if self.open else "PROC"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nixl, name)


def test_failed_is_sent_only_after_the_layer_writes_settle(
        pair: tuple[Engine, Engine, str]) -> None:
    sender, receiver, address = pair
    gate = GatedStates(sender.agent.writer.nixl)
    sender.agent.writer.nixl = gate
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6, 2], first_block=0)
    wait_until(registered(sender, "t1"))
    sender.agent.write_layer("t1", 0, [(0, 3), (1, 4)])
    # The request is aborted while its first layer is still being written.
    sender.agent.refuse("t1")
    assert holds_for(lambda: "rx" not in receiver.collect().finished_recving, 1.0)
    gate.open = True
    wait_until(receiver.received("rx"))
    assert receiver.results.failed_blocks == {6, 2}


def test_a_cancel_while_writes_are_in_flight_is_settled_after_them(
        pair: tuple[Engine, Engine, str], monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sc, "WRITE_GRACE_S", 0.3)
    gate = GatedStates(sender.agent.writer.nixl)
    sender.agent.writer.nixl = gate
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6, 2], first_block=0)
    wait_until(registered(sender, "t1"))
    sender.agent.write_layer("t1", 0, [(0, 3), (1, 4)])
    # The receiving request is aborted: it ends at once, its blocks quarantined.
    receiver.agent.cancel_receive("t1")
    wait_until(receiver.received("rx"))
    assert receiver.results.quarantined == {"rx"} and not receiver.results.failed_blocks
    # They come back only after the sender's writes settled and it said so, and a grace.
    assert holds_for(lambda: "rx" not in receiver.collect().settled, 1.0)
    gate.open = True
    wait_until(receiver.settled("rx"))
    assert receiver.results.counters.quarantines_expired == 0


# -- item 6: a NIXL call that raises fails its transfer only ------------------------------------

class DeadPeerStates(GatedStates):
    """NIXL raises on every call about a write to a peer that died mid-WRITE; writes posted
    while `dead` are such writes."""

    def __init__(self, nixl: Any) -> None:
        super().__init__(nixl)
        self.dead = True
        self._doomed: set[int] = set()

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        handle = self._nixl.make_prepped_xfer(*args, **kwargs)
        if self.dead:
            self._doomed.add(id(handle))
        return handle

    def check_xfer_state(self, handle: Any) -> str:
        if id(handle) in self._doomed:
            raise RuntimeError("nixlRemoteDisconnectError")
        return str(self._nixl.check_xfer_state(handle))

    def release_xfer_handle(self, handle: Any) -> None:
        if id(handle) in self._doomed:
            raise RuntimeError("nixlRemoteDisconnectError")
        self._nixl.release_xfer_handle(handle)


def test_a_peer_dying_mid_write_fails_only_its_transfer(pair: tuple[Engine, Engine, str]
                                                        ) -> None:
    sender, receiver, address = pair
    nixl = DeadPeerStates(sender.agent.writer.nixl)
    sender.agent.writer.nixl = nixl
    receiver.receive("rx1", "t1", address, [1], first_block=0)
    sender.send("tx1", "t1", [0])
    wait_until(sender.sent("tx1"))
    assert sender.results.counters.sends_failed == 1
    wait_until(receiver.received("rx1"))
    # The thread goes on: later transfers complete, and deadlines fire.
    nixl.dead = False
    receiver.receive("rx2", "t2", address, [2], first_block=0)
    sender.send("tx2", "t2", [4])
    wait_until(receiver.received("rx2"))
    wait_until(sender.sent("tx2"))
    assert torch.equal(receiver.buffer[:, 2], sender.buffer[:, 4])
    sender.send("tx3", "t3", [5])  # nobody registers: freed at the send timeout
    wait_until(sender.sent("tx3"), timeout=sender.agent.sending.send_timeout_s + 5)


# -- item 7: hellos are retried; agents that left are forgotten -----------------------------------

def test_a_hello_that_got_no_answer_is_sent_again() -> None:
    apply_poll_delay()
    receiver = Engine("receiver", fill=-1.0, receive_timeout_s=30.0)
    # Something took the hello and died without answering; a real sender comes up there.
    context = zmq.Context()
    swallow = context.socket(zmq.ROUTER)
    port = swallow.bind_to_random_port("tcp://127.0.0.1")
    address = f"127.0.0.1:{port}"
    receiver.receive("rx1", "t1", address, [1], first_block=0, timeout_s=30.0)
    assert swallow.poll(5000)
    swallow.recv_multipart()
    swallow.close(linger=0)
    context.term()
    sender = Engine("sender", fill=5.0, listen=True, port=port)
    try:
        sender.send("tx1", "t1", [0])
        wait_until(receiver.received("rx1"))
        assert receiver.results.failed_blocks == set()
        assert bool((receiver.buffer[:, 1] == 5.0).all())
    finally:
        sender.agent.close()
        receiver.agent.close()


def test_a_restarted_receiver_replaces_its_old_agent(pair: tuple[Engine, Engine, str]) -> None:
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


# -- item 8: deadlines follow the work that is really pending ------------------------------------

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


def test_a_queued_sender_request_is_waited_for(pair: tuple[Engine, Engine, str]) -> None:
    sender, receiver, address = pair
    # The receive times out after 1 s, but the sender's request is known: it is queued.
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6], first_block=0)
    time.sleep(2.5)
    sender.send("tx", "t1", [2])
    wait_until(receiver.received("rx"))
    assert receiver.results.failed_blocks == set()
    assert torch.equal(receiver.buffer[:, 6], sender.buffer[:, 2])


# -- item 12: the side channel answers only the cluster's engines -------------------------------

def test_messages_without_the_cluster_secret_are_dropped(pair: tuple[Engine, Engine, str]
                                                         ) -> None:
    sender, _, address = pair
    stranger = Engine("stranger", fill=-1.0, receive_timeout_s=1.0, secret=b"another")
    try:
        stranger.receive("rx", "t1", address, [1], first_block=0)
        sender.send("tx", "t1", [0])
        wait_until(stranger.received("rx"), timeout=5)
        assert stranger.results.failed_blocks == {1}
        assert untouched(stranger)
        # An unsigned message of the old format, too.
        context = zmq.Context()
        raw = context.socket(zmq.DEALER)
        raw.connect(f"tcp://{address}")
        raw.send(b"\x81\xa2op\xa5hello")
        raw.close(linger=0)
        context.term()
        wait_until(lambda: sender.collect().counters.side_channel_rejected >= 2)
        assert not sender.agent.writer.peers
    finally:
        stranger.agent.close()


def test_one_peer_can_hold_only_so_many_registrations(
        pair: tuple[Engine, Engine, str], monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sending, "MAX_REGISTRATIONS_PER_AGENT", 2)
    for n in range(3):
        receiver.receive(f"rx{n}", f"t{n}", address, [n], first_block=0, timeout_s=30.0)
    wait_until(receiver.received("rx2"))
    assert receiver.results.failed_blocks == {2}
    assert registered(sender, "t0")() and registered(sender, "t1")()


# -- per-layer cost: one transfer's writes are checked oldest first -------------------------------

class CountingWriter:
    """What `InFlight.settle` reads of a `Writer`: states, counted; handles complete in order."""

    def __init__(self) -> None:
        self.done = 0  # handles below this number have completed
        self.checks = 0

    def state(self, handle: int) -> str:
        self.checks += 1
        return "DONE" if handle < self.done else "PROC"

    def release(self, handle: int) -> None:
        pass


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


def test_two_requests_under_one_transfer_id_move_kv_for_one_only(
        pair: tuple[Engine, Engine, str]) -> None:
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


def test_a_send_abandoned_before_it_is_known_ends_at_once(pair: tuple[Engine, Engine, str]
                                                          ) -> None:
    sender, receiver, address = pair
    sender.agent.abandon("t1")  # the router's abandon overtook the request
    receiver.receive("rx", "t1", address, [1], first_block=0, timeout_s=30.0)
    wait_until(receiver.received("rx"))
    sender.send("tx", "t1", [0])
    wait_until(sender.sent("tx"), timeout=1.0)  # not after the send timeout
    assert receiver.results.failed_blocks == {1}
    assert untouched(receiver)


def test_a_sender_that_died_is_not_waited_for(pair: tuple[Engine, Engine, str]) -> None:
    """Its process gone (its side channel closed, nothing listening there): receives
    registered with it come back at once, and new ones do not register with a dead agent."""
    sender, receiver, address = pair
    receiver.receive("rx1", "t1", address, [1], first_block=0)
    sender.send("tx1", "t1", [0])
    wait_until(receiver.received("rx1"))
    sender.agent.expect("t2", PROMPT)
    receiver.receive("rx2", "t2", address, [2], first_block=0, timeout_s=30.0)
    wait_until(registered(sender, "t2"))
    sender.agent.close()  # the prefill engine is killed
    # Its request goes on at once, in other blocks: whether the sender died or the link to it
    # broke, the receiver cannot tell, so these stay held.
    wait_until(receiver.received("rx2"), timeout=3.0)
    assert receiver.results.quarantined == {"rx2"}
    # A turn that comes meanwhile: its receive waits for a sender to answer, and gives its
    # blocks back at once when its request is aborted (it never registered: nothing writes).
    receiver.receive("rx3", "t3", address, [3], first_block=0, timeout_s=30.0)
    time.sleep(0.3)
    receiver.agent.cancel_receive("t3")
    wait_until(receiver.received("rx3"), timeout=2.0)
    assert receiver.results.failed_blocks == {3}
    assert untouched(receiver, but=(1,))
