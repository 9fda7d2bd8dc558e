"""The transfer protocol between two real NIXL agents in one process (UCX over loopback).

Each agent owns a small CPU "KV cache"; the receiver registers blocks, the sender writes its
own blocks into them. Failures end both sides: the receiver reports its blocks for recompute.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.transport import TransferAgent, TransferResults
from turnkv_server.launcher.processes import free_ports
from turnkv_server.nixl_poll import apply_poll_delay

BLOCKS, LAYERS = 8, 2


class Engine:
    """An agent over its own cache: LAYERS layers of [BLOCKS, 4, 16] float32."""

    def __init__(self, name: str, port: int | None, fill: float, **timeouts: float) -> None:
        self.buffer = torch.full((LAYERS, BLOCKS, 4, 16), fill)
        layers = list(self.buffer.unbind(0))
        self.agent = TransferAgent(name, BlockTable.from_layers(layers, BLOCKS),
                                   ("127.0.0.1", port) if port else None, **timeouts)
        storage = self.buffer.untyped_storage()
        self.agent.register_memory([(storage.data_ptr(), storage.nbytes())])
        self.agent.start()
        self.results = TransferResults()

    def collect(self) -> TransferResults:
        new = self.agent.take_results()
        self.results.finished_sending |= new.finished_sending
        self.results.finished_recving |= new.finished_recving
        self.results.failed_blocks |= new.failed_blocks
        self.results.counters.add(new.counters)
        return self.results


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine, str]]:
    apply_poll_delay()
    port = free_ports(1)[0]
    sender = Engine("sender", port, fill=0.0)
    receiver = Engine("receiver", None, fill=-1.0, receive_timeout_s=1.0)
    for b in range(BLOCKS):
        sender.buffer[:, b] = b + 1.0  # every byte of block b says b + 1
    yield sender, receiver, f"127.0.0.1:{port}"
    receiver.agent.close()
    sender.agent.close()


def test_the_sender_writes_exactly_the_registered_blocks(pair: tuple[Engine, Engine, str]
                                                        ) -> None:
    sender, receiver, address = pair
    # The sender's request held blocks 0..4 (block i of its prompt); the receiver lacks
    # prompt blocks 2..4 and allocated its blocks 7, 1, 5 for them.
    receiver.agent.receive("rx", "t1", address, [7, 1, 5], first_block=2)
    sender.agent.send("tx", "t1", [0, 1, 2, 3, 4])
    wait_until(lambda: "rx" in receiver.collect().finished_recving)
    wait_until(lambda: "tx" in sender.collect().finished_sending)
    for dest, source in ((7, 2), (1, 3), (5, 4)):
        assert torch.equal(receiver.buffer[:, dest], sender.buffer[:, source])
    untouched = [b for b in range(BLOCKS) if b not in (7, 1, 5)]
    assert bool((receiver.buffer[:, untouched] == -1.0).all())
    assert receiver.results.failed_blocks == set()
    assert receiver.results.counters.blocks_received == 3
    assert sender.results.counters.bytes_sent == 3 * LAYERS * 4 * 16 * 4


def test_registration_before_or_after_the_send_both_work(pair: tuple[Engine, Engine, str]
                                                         ) -> None:
    sender, receiver, address = pair
    sender.agent.send("tx", "t1", [3])
    time.sleep(0.1)
    receiver.agent.receive("rx", "t1", address, [6], first_block=0)
    wait_until(lambda: "rx" in receiver.collect().finished_recving)
    assert torch.equal(receiver.buffer[:, 6], sender.buffer[:, 3])


def test_a_refused_or_short_transfer_fails_to_recompute(pair: tuple[Engine, Engine, str]
                                                        ) -> None:
    sender, receiver, address = pair
    sender.agent.refuse("t1")
    receiver.agent.receive("rx1", "t1", address, [1, 2], first_block=0)
    wait_until(lambda: "rx1" in receiver.collect().finished_recving)
    assert receiver.results.failed_blocks == {1, 2}
    # The sender holds two blocks; the receiver asks for three.
    receiver.agent.receive("rx2", "t2", address, [3, 4, 5], first_block=0)
    sender.agent.send("tx2", "t2", [0, 1])
    wait_until(lambda: "rx2" in receiver.collect().finished_recving)
    wait_until(lambda: "tx2" in sender.collect().finished_sending)
    assert receiver.results.failed_blocks == {1, 2, 3, 4, 5}
    assert sender.results.counters.sends_failed == 1
    assert bool((receiver.buffer == -1.0).all())


def test_a_silent_peer_times_out(pair: tuple[Engine, Engine, str]) -> None:
    _, receiver, _ = pair
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    receiver.agent.receive("rx", "t1", dead, [2], first_block=0)
    wait_until(lambda: "rx" in receiver.collect().finished_recving, timeout=5)
    assert receiver.results.failed_blocks == {2}
    assert receiver.results.counters.receives_failed == 1


def test_a_declined_transfer_lets_the_sender_go(pair: tuple[Engine, Engine, str]) -> None:
    sender, receiver, address = pair
    receiver.agent.decline("t1", address)
    time.sleep(0.1)
    sender.agent.send("tx", "t1", [0])
    wait_until(lambda: "tx" in sender.collect().finished_sending)
    assert sender.results.counters.sends_failed == 0


def test_a_restarted_sender_gets_a_new_handshake(pair: tuple[Engine, Engine, str]) -> None:
    sender, receiver, address = pair
    receiver.agent.receive("rx1", "t1", address, [1], first_block=0)
    sender.agent.send("tx1", "t1", [0])
    wait_until(lambda: "rx1" in receiver.collect().finished_recving)
    # The sender restarts on the same address: a new agent that has never met the receiver.
    sender.agent.close()
    port = int(address.rsplit(":", 1)[1])
    restarted = Engine("sender", port, fill=9.0)
    try:
        receiver.agent.receive("rx2", "t2", address, [2], first_block=0)
        restarted.agent.send("tx2", "t2", [5])
        wait_until(lambda: "rx2" in receiver.collect().finished_recving)
        assert receiver.results.failed_blocks == set()
        assert bool((receiver.buffer[:, 2] == 9.0).all())
    finally:
        restarted.agent.close()


def test_an_abandoned_send_frees_its_blocks_and_fails_a_late_registration(
        pair: tuple[Engine, Engine, str]) -> None:
    sender, receiver, address = pair
    sender.agent.send("tx", "t1", [0, 1])
    sender.agent.abandon("t1")  # the sender's engine needs the blocks; nobody registered yet
    wait_until(lambda: "tx" in sender.collect().finished_sending)
    assert sender.results.counters.sends_failed == 1
    receiver.agent.receive("rx", "t1", address, [3, 4], first_block=0)
    wait_until(lambda: "rx" in receiver.collect().finished_recving)
    assert receiver.results.failed_blocks == {3, 4}
    assert bool((receiver.buffer == -1.0).all())


def registered(engine: Engine, transfer_id: str) -> Callable[[], bool]:
    # The sender's thread owns its registrations; reading the dict's keys is enough here.
    return lambda: transfer_id in engine.agent._regs


def test_layers_written_during_the_request_are_not_written_again(
        pair: tuple[Engine, Engine, str]) -> None:
    sender, receiver, address = pair
    # The request's blocks are 0..4; the receiver lacks 2..4, into its blocks 7, 1, 5.
    receiver.agent.receive("rx", "t1", address, [7, 1, 5], first_block=2)
    wait_until(registered(sender, "t1"))
    sender.agent.write_layer("t1", 0, [(0, 0), (1, 1), (2, 2), (3, 3)])  # 0, 1: not wanted
    sender.agent.write_layer("t1", 1, [(2, 2)])
    wait_until(lambda: bool((receiver.buffer[1, 7] == 3.0).all()))
    streamed = sender.buffer.clone()
    # Were blocks 2 and 3 rewritten at the end, these new bytes would show at the receiver.
    sender.buffer[:, 2:5] += 100.0
    sender.agent.send("tx", "t1", [0, 1, 2, 3, 4])
    wait_until(lambda: "rx" in receiver.collect().finished_recving)
    wait_until(lambda: "tx" in sender.collect().finished_sending)
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
    untouched = [b for b in range(BLOCKS) if b not in (7, 1, 5)]
    assert bool((receiver.buffer[:, untouched] == -1.0).all())


def test_a_fully_streamed_transfer_still_notifies(pair: tuple[Engine, Engine, str]) -> None:
    sender, receiver, address = pair
    receiver.agent.receive("rx", "t1", address, [6, 2], first_block=0)
    wait_until(registered(sender, "t1"))
    for layer in range(LAYERS):
        sender.agent.write_layer("t1", layer, [(0, 3), (1, 4)])
    sender.agent.send("tx", "t1", [3, 4])
    wait_until(lambda: "rx" in receiver.collect().finished_recving)
    assert receiver.results.failed_blocks == set()
    assert torch.equal(receiver.buffer[:, 6], sender.buffer[:, 3])
    assert torch.equal(receiver.buffer[:, 2], sender.buffer[:, 4])


def test_a_restarted_request_is_written_whole_at_the_end(pair: tuple[Engine, Engine, str]
                                                         ) -> None:
    sender, receiver, address = pair
    receiver.agent.receive("rx", "t1", address, [6, 2], first_block=0)
    wait_until(registered(sender, "t1"))
    sender.agent.write_layer("t1", 0, [(0, 3), (1, 4)])
    # Preempted: its blocks may have been reused, so nothing streamed so far is trusted, nor
    # anything streamed after (an old write could land after a new one).
    sender.agent.write_layer("t1", 0, [], restart=True)
    sender.agent.write_layer("t1", 1, [(0, 3), (1, 4)])
    sender.buffer[:, 3:5] += 100.0
    sender.agent.send("tx", "t1", [3, 4])
    wait_until(lambda: "rx" in receiver.collect().finished_recving)
    assert torch.equal(receiver.buffer[:, 6], sender.buffer[:, 3])
    assert torch.equal(receiver.buffer[:, 2], sender.buffer[:, 4])
