"""The side channel answers only the cluster's engines, between two real NIXL agents in one
process: signed messages under the cluster's secret, bounded per peer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.unit.transfer_pair import (
    MODEL,
    PROMPT,
    SECRET,
    Engine,
    Pair,
    RecordingProxy,
    SideChannelClient,
    SilentSender,
    engine_pair,
    holds_for,
    registered,
    untouched,
    wait_until,
)
from turnkv_server.connector import sending
from turnkv_server.connector import side_channel as sc
from turnkv_server.connector.blocktable import BlockTable
from turnkv_server.connector.incoming import NOTIF_PREFIX

OTHER_SECRET = b"9d2b71e0c4a8f6350e1b7c9a2d4f8e61"


@pytest.fixture
def pair() -> Iterator[Pair]:
    with engine_pair() as engines:
        yield engines


def test_messages_without_the_cluster_secret_are_dropped(pair: Pair) -> None:
    sender, _, address = pair
    stranger = Engine("stranger", fill=-1.0, receive_timeout_s=1.0, secret=OTHER_SECRET)
    try:
        stranger.receive("rx", "t1", address, [1], first_block=0)
        sender.send("tx", "t1", [0])
        wait_until(stranger.received("rx"), timeout=5)
        assert stranger.results.failed_blocks == {1}
        assert untouched(stranger)
        assert not sender.agent.writer.peers
    finally:
        stranger.agent.close()
    # An unsigned message of the old format, on a connection of the cluster's.
    client = SideChannelClient(address)
    try:
        client.send([b"\x81\xa2op\xa5hello"])
        wait_until(lambda: sender.collect().counters.side_channel_rejected >= 1)
        assert client.answer(0.2) is None
        assert not sender.agent.writer.peers
    finally:
        client.close()


def test_one_peer_can_hold_only_so_many_registrations(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    sender, receiver, address = pair
    monkeypatch.setattr(sending, "MAX_REGISTRATIONS_PER_AGENT", 2)
    for n in range(3):
        receiver.receive(f"rx{n}", f"t{n}", address, [n], first_block=0, timeout_s=30.0)
    wait_until(receiver.received("rx2"))
    assert receiver.results.failed_blocks == {2}
    assert registered(sender, "t0")() and registered(sender, "t1")()


# -- a receive completes only on its sender's notification ------------------------------------

def test_a_completion_notification_from_another_agent_is_ignored(pair: Pair) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    sender, receiver, address = pair
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx1", "t1", address, [1], first_block=0, timeout_s=30.0)
    wait_until(registered(sender, "t1"))
    # Another peer learns the receiver's NIXL metadata from its hello, as any sender does, and
    # notifies the receiver that t1, registered with the real sender, is complete.
    forger = SilentSender()
    try:
        receiver.receive("rx2", "t2", forger.address, [2], first_block=0, timeout_s=30.0)
        forger.serve_until_registered()
        (hello,) = [m for m in forger.seen if isinstance(m, sc.Hello)]
        agent = nixl_agent("forger", nixl_agent_config(backends=["UCX"]))
        name = agent.add_remote_agent(hello.meta)
        agent.send_notif(name, NOTIF_PREFIX + b"t1")
        wait_until(lambda: receiver.collect().counters.notifications_rejected == 1)
        assert "rx1" not in receiver.results.finished_recving
        agent.remove_remote_agent(name)
    finally:
        forger.close()
    # The real sender's completes it.
    sender.send("tx1", "t1", [0])
    wait_until(receiver.received("rx1"))
    assert receiver.results.failed_blocks == set()
    assert bool((receiver.buffer[:, 1] == 1.0).all())


# -- what the side channel accepts: secrets, freshness, replays --------------------------------

@pytest.mark.parametrize("secret", [
    b"cluster-secret",  # too short
    b"REPLACE-ME-side-channel-secret",  # the Kubernetes base's placeholder
    b"REPLACE-ME-side-channel-secret-with-some-more-bytes",
    b"change-me-change-me-change-me-change-me",
    b"changeme0123456789abcdef0123456789",
    b"",
])
def test_short_or_placeholder_secrets_are_refused(secret: bytes) -> None:
    with pytest.raises(ValueError, match="secret"):
        sc.Codec(secret)


def test_a_random_secret_of_32_bytes_is_accepted() -> None:
    sc.Codec(SECRET)
    sc.Codec(bytes.fromhex("00ff") * 16)


def hello(agent: str, engine_id: str) -> sc.Hello:
    """A hello from a peer of another model: refused, which answers it (only a message the
    side channel accepts is answered)."""
    table = BlockTable(1, ((0, 64, 0),)).to_wire()
    return sc.Hello(agent=agent, engine_id=engine_id, meta=b"", table=table,
                    fingerprint=MODEL.with_fields({"dtype": "int4"}).to_wire())


def answered(client: SideChannelClient, frames: list[bytes]) -> bool:
    return client.send(frames) and client.answer(1.0) is not None


@pytest.mark.parametrize("age_s", [sc.MAX_AGE_S + 30, -(sc.MAX_AGE_S + 30)])
def test_a_stale_message_is_dropped_unanswered(pair: Pair, age_s: float) -> None:
    sender, _, address = pair
    client = SideChannelClient(address)
    try:
        assert answered(client, sc.Codec(SECRET).encode(hello("fresh", "e1")))
        stale = sc.Codec(SECRET, clock=lambda: time.time() - age_s)
        assert not answered(client, stale.encode(hello("stale", "e2")))
        assert sender.collect().counters.side_channel_rejected == 1
    finally:
        client.close()


def test_a_replayed_message_is_dropped_unanswered(pair: Pair) -> None:
    sender, _, address = pair
    client = SideChannelClient(address)
    try:
        frames = sc.Codec(SECRET).encode(hello("once", "e1"))
        assert answered(client, frames)
        assert not answered(client, frames)
        assert sender.collect().counters.side_channel_rejected == 1
    finally:
        client.close()


def test_an_older_hello_does_not_replace_an_engines_agent(pair: Pair) -> None:
    """A hello of the receiver's engine from before its current agent's (its previous
    process's, held back and sent late): signed, fresh enough, never seen, and still not
    allowed to make the sender drop the agent that now serves the engine."""
    sender, receiver, address = pair
    sender.agent.expect("t1", PROMPT)
    receiver.receive("rx", "t1", address, [1], first_block=0, timeout_s=30.0)
    wait_until(registered(sender, "t1"))
    earlier = sc.Codec(SECRET, clock=lambda: time.time() - 30)
    old = hello("turnkv-receiver-old", "receiver")
    old.fingerprint = receiver.agent.fingerprint.to_wire()
    old.table = receiver.agent.table.to_wire()
    client = SideChannelClient(address)
    try:
        assert not answered(client, earlier.encode(old))
    finally:
        client.close()
    assert holds_for(registered(sender, "t1"), 0.5)
    assert list(sender.agent.writer.peers) == [receiver.agent.name]
    sender.send("tx", "t1", [0])
    wait_until(receiver.received("rx"))
    assert receiver.results.failed_blocks == set()


# -- what a listener on the network sees -----------------------------------------------------

def test_the_side_channel_is_encrypted(pair: Pair) -> None:
    sender, receiver, address = pair
    with RecordingProxy(address) as proxy:
        receiver.receive("rx", "t1", proxy.address, [1], first_block=0)
        sender.send("tx", "t1", [0])
        wait_until(receiver.received("rx"))
        assert receiver.results.failed_blocks == set()
        # Every message names its agent, and the hello carries the NIXL metadata: none of it
        # crosses the network in the clear.
        assert proxy.recorded() and receiver.agent.name.encode() not in proxy.recorded()
    # A connection without the cluster's keys gets nothing through, signed or not.
    plain = SideChannelClient(address, encrypted=False)
    try:
        assert not answered(plain, sc.Codec(SECRET).encode(hello("plain", "e1")))
        assert sender.collect().counters.side_channel_rejected == 0
    finally:
        plain.close()


def test_the_replay_cache_forgets_a_nonce_once_its_message_left_the_window() -> None:
    cache = sc.ReplayCache(limit=2)
    cache.admit(b"a", sent_at=0.0, now=0.0)
    with pytest.raises(sc.Rejected, match="replayed"):
        cache.admit(b"a", sent_at=0.0, now=sc.MAX_AGE_S)
    cache.admit(b"b", sent_at=1.0, now=1.0)
    # Full: a message it cannot remember is dropped, never let through unchecked.
    with pytest.raises(sc.Rejected, match="too many"):
        cache.admit(b"c", sent_at=2.0, now=2.0)
    # Past their window, "a" and "b" are stale anyway: they are forgotten, and room is made.
    cache.admit(b"c", sent_at=sc.MAX_AGE_S + 2, now=sc.MAX_AGE_S + 2)
    assert len(cache) == 1
