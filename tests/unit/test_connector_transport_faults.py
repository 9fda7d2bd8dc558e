"""The transfer protocol's failures, between two real NIXL agents in one process: a receiver
reports its blocks for recompute once no write of the sender can still land in them, or, when
it cannot know that, quarantines them (its request recomputes elsewhere) until it can. A slow
link or a peer dying mid-write is simulated by wrapping the sender's NIXL agent
(`transfer_pair.GatedStates`, `DeadPeerStates`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from tests.unit.transfer_pair import (
    PROMPT,
    SECRET,
    DeadPeerStates,
    Engine,
    GatedStates,
    Pair,
    SilentSender,
    engine_pair,
    holds_for,
    registered,
    untouched,
    unused_address,
    wait_until,
    writing,
)
from turnkv_server.connector import outgoing, receiving
from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.cluster_secret import ClusterKeys
from turnkv_server.engine.nixl_poll import apply_poll_delay


@pytest.fixture
def pair() -> Iterator[Pair]:
    with engine_pair() as engines:
        yield engines


def test_a_silent_peer_times_out(pair: Pair) -> None:
    _, receiver, _ = pair
    receiver.receive("rx", "t1", unused_address(), [2], first_block=0)
    wait_until(receiver.received("rx"), timeout=5)
    assert receiver.results.failed_blocks == {2}
    assert receiver.results.counters.receives_failed == 1


def test_a_sender_restarted_mid_transfer_settles_the_quarantine_after_the_grace(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
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


# -- a receiver hands its blocks back only when no write can still land ----------------------------

def test_a_receiver_that_gives_up_on_a_silent_sender_quarantines_its_blocks(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
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


def test_failed_is_sent_only_after_the_layer_writes_settle(
        patient_pair: Pair) -> None:
    # A receiver that waits long for its KV: `pair`'s gives up after 1 s, as long as this
    # test watches it stay open, and once did inside that second.
    sender, receiver, address = patient_pair
    gate = GatedStates(sender.agent.writer.nixl)
    sender.agent.writer.nixl = gate
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6, 2], first_block=0)
    wait_until(registered(sender, "t1"))
    sender.agent.write_layer("t1", 0, [(0, 3), (1, 4)])
    wait_until(writing(sender, "t1"))
    # The request is aborted while its first layer is still being written.
    sender.agent.refuse("t1")
    assert holds_for(lambda: "rx" not in receiver.collect().finished_recving, 1.0)
    gate.open = True
    wait_until(receiver.received("rx"))
    assert receiver.results.failed_blocks == {6, 2}


def test_a_cancel_while_writes_are_in_flight_is_settled_after_them(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sc, "WRITE_GRACE_S", 0.3)
    gate = GatedStates(sender.agent.writer.nixl)
    sender.agent.writer.nixl = gate
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6, 2], first_block=0)
    wait_until(registered(sender, "t1"))
    sender.agent.write_layer("t1", 0, [(0, 3), (1, 4)])
    wait_until(writing(sender, "t1"))
    # The receiving request is aborted: it ends at once, its blocks quarantined.
    receiver.agent.cancel_receive("t1")
    wait_until(receiver.received("rx"))
    assert receiver.results.quarantined == {"rx"} and not receiver.results.failed_blocks
    # They come back only after the sender's writes settled and it said so, and a grace.
    assert holds_for(lambda: "rx" not in receiver.collect().settled, 1.0)
    gate.open = True
    wait_until(receiver.settled("rx"))
    assert receiver.results.counters.quarantines_expired == 0


def test_a_sender_that_died_is_not_waited_for(pair: Pair) -> None:
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


# -- a NIXL call that raises fails its transfer only -----------------------------------------------

def test_a_peer_dying_mid_write_fails_only_its_transfer(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sc, "WRITE_GRACE_S", 0.3)
    monkeypatch.setattr(receiving, "QUARANTINE_MAX_S", 3.0)
    nixl = DeadPeerStates(sender.agent.writer.nixl)
    sender.agent.writer.nixl = nixl
    receiver.receive("rx1", "t1", address, [1], first_block=0, timeout_s=30.0)
    sender.send("tx1", "t1", [0])
    wait_until(sender.sent("tx1"))
    assert sender.results.counters.sends_failed == 1
    # NIXL gave the write up but could not cancel it: over TCP it may still land. The
    # receiver's request goes on in other blocks at once, and these stay held, past the
    # grace that a settled transfer would get.
    wait_until(receiver.received("rx1"))
    assert receiver.results.quarantined == {"rx1"} and not receiver.results.failed_blocks
    assert holds_for(lambda: "rx1" not in receiver.collect().settled, 1.0)
    # The thread goes on: later transfers complete, and deadlines fire.
    nixl.dead = False
    receiver.receive("rx2", "t2", address, [2], first_block=0)
    sender.send("tx2", "t2", [4])
    wait_until(receiver.received("rx2"))
    wait_until(sender.sent("tx2"))
    assert torch.equal(receiver.buffer[:, 2], sender.buffer[:, 4])
    sender.send("tx3", "t3", [5])  # nobody registers: freed at the send timeout
    wait_until(sender.sent("tx3"), timeout=sender.agent.sending.send_timeout_s + 5)
    # With no word that the write is over, the blocks come back only at the longest bound.
    wait_until(receiver.settled("rx1"), timeout=5.0)
    assert receiver.results.counters.quarantines_expired == 1


def test_a_write_nixl_would_not_release_is_released_once_it_can_be(pair: Pair) -> None:
    sender, receiver, address = pair
    nixl = DeadPeerStates(sender.agent.writer.nixl)
    sender.agent.writer.nixl = nixl
    receiver.receive("rx", "t1", address, [1], first_block=0, timeout_s=30.0)
    sender.send("tx", "t1", [0])
    wait_until(sender.sent("tx"))
    # The handle is kept, and its agent with it (removing an agent under an active write
    # is not safe), until NIXL lets the write go.
    writer = sender.agent.writer
    assert holds_for(lambda: writer.unreleased() == 1 and receiver.agent.name in writer.peers,
                     0.5)
    nixl.recover()
    wait_until(lambda: writer.unreleased() == 0)


def test_a_write_that_failed_keeps_a_cancelled_receives_blocks_held(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sc, "WRITE_GRACE_S", 0.3)
    # Long enough that the second below ends inside it however slowly the steps before it
    # ran (under `make test` the engines share the cores: 3 s once fell short).
    monkeypatch.setattr(receiving, "QUARANTINE_MAX_S", 6.0)
    gate = GatedStates(sender.agent.writer.nixl, fail=True)
    sender.agent.writer.nixl = gate
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [6, 2], first_block=0, timeout_s=30.0)
    wait_until(registered(sender, "t1"))
    sender.agent.write_layer("t1", 0, [(0, 3), (1, 4)])
    wait_until(writing(sender, "t1"))
    receiver.agent.cancel_receive("t1")
    wait_until(receiver.received("rx"))
    assert receiver.results.quarantined == {"rx"}
    # The layer's write ends in an error: the sender answers the cancel, saying that what it
    # wrote may still land, and the blocks stay held past the grace.
    gate.open = True
    wait_until(lambda: not registered(sender, "t1")())
    assert holds_for(lambda: "rx" not in receiver.collect().settled, 1.0)
    wait_until(receiver.settled("rx"), timeout=10.0)
    assert receiver.results.counters.quarantines_expired == 1


def test_a_hello_that_got_no_answer_is_sent_again() -> None:
    apply_poll_delay()
    receiver = Engine("receiver", fill=-1.0, receive_timeout_s=30.0)
    # Something took the hello and died without answering; a real sender comes up there.
    context = zmq.Context()
    swallow = context.socket(zmq.ROUTER)
    ClusterKeys(SECRET).serve(swallow)
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


# -- a quarantine costs the transfer thread nothing while it waits ------------------------------

def test_a_thread_holding_only_a_quarantine_sleeps(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    _, receiver, _ = pair
    monkeypatch.setattr(receiving, "QUARANTINE_MAX_S", 60.0)
    silent = SilentSender()
    try:
        receiver.receive("rx", "t1", silent.address, [1, 2], first_block=0, timeout_s=0.3)
        silent.serve_until_registered()
        wait_until(receiver.received("rx"))
        assert receiver.results.quarantined == {"rx"}
        # Nothing to poll NIXL for but the quarantine's notification, which can wait for the
        # slow cadence: the thread wakes a few times a second, not every tick.
        before = receiver.agent.passes
        time.sleep(1.0)
        assert receiver.agent.passes - before <= 10
    finally:
        silent.close()


class HeldNotifications:
    """The receiver's NIXL agent, holding the notifications that arrive until `release`: a
    notification that comes late, on a machine where loopback writes complete at once."""

    def __init__(self, nixl: Any) -> None:
        self._nixl = nixl
        self._held: dict[str, list[bytes]] = {}
        self.released = False

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        for agent, messages in self._nixl.get_new_notifs().items():
            self._held.setdefault(agent, []).extend(messages)
        if not self.released:
            return {}
        held, self._held = self._held, {}
        return held

    def __getattr__(self, name: str) -> Any:
        return getattr(self._nixl, name)


def test_a_late_notification_settles_a_quarantine_without_fast_polling(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sc, "WRITE_GRACE_S", 60.0)
    held = HeldNotifications(receiver.agent.receiving.nixl)
    receiver.agent.receiving.nixl = held
    receiver.receive("rx", "t1", address, [1], first_block=0, timeout_s=0.5)
    sender.send("tx", "t1", [0])
    wait_until(sender.sent("tx"))
    # Written, but its notification held back: the receive gives up at its deadline.
    wait_until(receiver.received("rx"))
    assert receiver.results.quarantined == {"rx"}
    held.released = True
    wait_until(receiver.settled("rx"), timeout=5.0)  # not after the 60 s grace
    assert receiver.results.counters.quarantines_expired == 0


# -- one transfer that fails inside the thread ends alone -------------------------------------

@pytest.fixture
def patient_pair() -> Iterator[Pair]:
    """A pair whose receiver waits up to 30 s for its KV."""
    with engine_pair(receive_timeout_s=30.0) as engines:
        yield engines


def test_a_send_that_raises_ends_alone(patient_pair: Pair,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = patient_pair
    real = outgoing.Outgoing.last_write_source

    def broken(out: outgoing.Outgoing) -> list[int]:
        if out.transfer_id == "t1":
            raise RuntimeError("a bug in one transfer")
        return real(out)

    monkeypatch.setattr(outgoing.Outgoing, "last_write_source", broken)
    receiver.receive("rx1", "t1", address, [1], first_block=0, timeout_s=30.0)
    receiver.receive("rx2", "t2", address, [2], first_block=0, timeout_s=30.0)
    wait_until(lambda: registered(sender, "t1")() and registered(sender, "t2")())
    sender.send("tx1", "t1", [0])
    sender.send("tx2", "t2", [4])
    wait_until(sender.sent("tx2"))
    wait_until(receiver.received("rx2"))
    assert torch.equal(receiver.buffer[:, 2], sender.buffer[:, 4])
    # The broken one failed before it wrote anything: its receiver recomputes in place.
    wait_until(sender.sent("tx1"))
    wait_until(receiver.received("rx1"))
    assert receiver.results.failed_blocks == {1}
    assert untouched(receiver, but=(2,))


class Corrupt:
    """A value no comparison accepts: a receive's state that a bug broke."""

    def __lt__(self, other: object) -> bool:
        raise RuntimeError("corrupt state")

    __gt__ = __le__ = __ge__ = __lt__


def test_a_receive_that_raises_ends_alone(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sc, "WRITE_GRACE_S", 0.3)
    for transfer_id in ("t1", "t2"):
        sender.agent.expect(transfer_id, PROMPT)
    receiver.receive("rx1", "t1", address, [1], first_block=0, timeout_s=30.0)
    receiver.receive("rx2", "t2", address, [2], first_block=0, timeout_s=30.0)
    wait_until(lambda: registered(sender, "t1")() and registered(sender, "t2")())
    receiver.agent.receiving.receives["t1"].deadline = Corrupt()  # type: ignore[assignment]
    # The other receive is given up and settles after the sender's word, as ever.
    receiver.agent.cancel_receive("t2")
    wait_until(receiver.settled("rx2"), timeout=5.0)
    # The broken one was registered: what the sender writes may land, so it is quarantined.
    assert "rx1" in receiver.results.quarantined and not receiver.results.failed_blocks
