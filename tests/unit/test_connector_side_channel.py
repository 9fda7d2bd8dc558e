"""The side channel answers only the cluster's engines, between two real NIXL agents in one
process: signed messages under the cluster's secret, bounded per peer.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from tests.unit.transfer_pair import (
    Engine,
    Pair,
    engine_pair,
    registered,
    untouched,
    wait_until,
)
from turnkv_server.connector import sending


@pytest.fixture
def pair() -> Iterator[Pair]:
    with engine_pair() as engines:
        yield engines


def test_messages_without_the_cluster_secret_are_dropped(pair: Pair
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
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sending, "MAX_REGISTRATIONS_PER_AGENT", 2)
    for n in range(3):
        receiver.receive(f"rx{n}", f"t{n}", address, [n], first_block=0, timeout_s=30.0)
    wait_until(receiver.received("rx2"))
    assert receiver.results.failed_blocks == {2}
    assert registered(sender, "t0")() and registered(sender, "t1")()
