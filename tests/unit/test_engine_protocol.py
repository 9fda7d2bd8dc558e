"""`kv_transfer_params["turnkv"]`: what the router writes is what the connector reads, and what
the connector answers is what the router reads."""

from __future__ import annotations

import pytest

from turnkv_server.engine.protocol import (
    BadParams,
    Receive,
    Send,
    TurnParams,
    TurnReply,
    parse,
    parse_reply,
)


def test_round_trip() -> None:
    params = TurnParams(session="s", ttl_s=30.0, priority=2,
                        receive=Receive("t-1", "127.0.0.1:5000", 99, 10.0), send=Send("t-2"))
    assert parse({"turnkv": params.to_wire()}) == params
    assert parse({"turnkv": TurnParams(release=True).to_wire()}) == TurnParams(release=True)


@pytest.mark.parametrize("hint", [0.0, 2.5, 600.0])
def test_the_next_turn_hint_round_trips_and_is_left_out_when_unset(hint: float) -> None:
    params = TurnParams(session="s", ttl_s=30.0, next_turn_in_s=hint)
    wire = params.to_wire()
    assert wire["next_turn_in_s"] == hint  # "back at once" (0) is a hint too
    assert parse({"turnkv": wire}) == params
    assert "next_turn_in_s" not in TurnParams(session="s").to_wire()
    assert parse({"turnkv": {"session": "s", "next_turn_in_s": 8}}) == TurnParams(
        session="s", next_turn_in_s=8.0)


def test_a_renew_only_request_round_trips_and_is_left_out_when_unset() -> None:
    """A hint sent between turns: renew the session's lease, hold nothing of the request."""
    params = TurnParams(session="s", ttl_s=90.0, priority=1, next_turn_in_s=60.0,
                        renew_only=True)
    wire = params.to_wire()
    assert wire == {"session": "s", "ttl_s": 90.0, "priority": 1, "next_turn_in_s": 60.0,
                    "renew_only": True}
    assert parse({"turnkv": wire}) == params
    assert "renew_only" not in TurnParams(session="s").to_wire()
    assert parse({"turnkv": {"session": "s"}}) == TurnParams(session="s")


def test_the_epoch_round_trips_and_is_left_out_when_unset() -> None:
    """Which life of the session a request belongs to; 0 is an epoch too."""
    for epoch in (0, 1_700_000_000_000_000):
        params = TurnParams(session="s", release=True, epoch=epoch)
        assert params.to_wire() == {"session": "s", "release": True, "epoch": epoch}
        assert parse({"turnkv": params.to_wire()}) == params
    assert "epoch" not in TurnParams(session="s").to_wire()


@pytest.mark.parametrize("raw", [
    {"session": "s", "renew_only": "yes"},
    {"session": "s", "renew_only": 1},
    {"session": "s", "renew_only": None},
    {"renew_only": True},  # whose lease?
    {"session": "s", "renew_only": True, "release": True},
    {"session": "s", "renew_only": True, "send": {"transfer_id": "t"}},
    {"session": "s", "renew_only": True, "receive": {"transfer_id": "t", "peer": "h:1"}},
])
def test_malformed_renew_only_is_refused(raw: object) -> None:
    with pytest.raises(BadParams, match="renew_only"):
        parse({"turnkv": raw})


def test_other_connectors_params_are_not_ours() -> None:
    assert parse(None) is None
    assert parse({"do_remote_decode": True}) is None


@pytest.mark.parametrize(("raw", "field"), [
    ("nope", "turnkv must be an object"),
    ({"session": ""}, "session"),
    ({"session": 3}, "session"),
    ({"ttl_s": 0}, "ttl_s"),
    ({"ttl_s": True}, "ttl_s"),
    ({"next_turn_in_s": -1}, "next_turn_in_s"),
    ({"next_turn_in_s": True}, "next_turn_in_s"),
    ({"next_turn_in_s": "8"}, "next_turn_in_s"),
    ({"next_turn_in_s": float("nan")}, "next_turn_in_s"),
    ({"next_turn_in_s": float("inf")}, "next_turn_in_s"),
    ({"priority": "high"}, "priority"),
    ({"release": "yes"}, "release"),
    ({"receive": {"transfer_id": "t", "peer": "nohost"}}, "peer"),
    ({"receive": {"transfer_id": "", "peer": "h:1"}}, "transfer_id"),
    ({"receive": {"transfer_id": "t", "peer": "h:1", "peer_tokens": -1}}, "peer_tokens"),
    ({"receive": {"transfer_id": "t", "peer": "h:1", "timeout_s": 0}}, "timeout_s"),
    ({"send": {"transfer_id": "a b"}}, "transfer_id"),
    ({"send": []}, "send"),
    ({"epoch": -1}, "epoch"),
    ({"epoch": 1.5}, "epoch"),
    ({"epoch": True}, "epoch"),
    ({"epoch": "7"}, "epoch"),
])
def test_malformed_params_name_the_field(raw: object, field: str) -> None:
    with pytest.raises(BadParams, match=field):
        parse({"turnkv": raw})


def test_abandon_and_stream_round_trip_and_are_left_out_when_unset() -> None:
    params = TurnParams(session="s", send=Send("t-1", stream=True), abandon=("t-2", "t-3"))
    wire = params.to_wire()
    assert wire["abandon"] == ["t-2", "t-3"] and wire["send"] == {"transfer_id": "t-1",
                                                                  "stream": True}
    assert parse({"turnkv": wire}) == params
    plain = TurnParams(session="s", send=Send("t-1")).to_wire()
    assert plain == {"session": "s", "send": {"transfer_id": "t-1"}}
    assert parse({"turnkv": plain}) == TurnParams(session="s", send=Send("t-1"))


@pytest.mark.parametrize("raw", [
    {"abandon": "t-1"},
    {"abandon": ["ok", "not ok"]},
    {"abandon": [3]},
    {"abandon": [f"t{i}" for i in range(65)]},
])
def test_malformed_abandon_is_refused(raw: object) -> None:
    with pytest.raises(BadParams, match="abandon"):
        parse({"turnkv": raw})


def test_malformed_stream_is_refused() -> None:
    with pytest.raises(BadParams, match="stream"):
        parse({"turnkv": {"send": {"transfer_id": "t", "stream": "yes"}}})


def test_the_reply_round_trips_and_other_params_carry_none() -> None:
    reply = TurnReply(held_blocks=3, local_tokens=256, received_tokens=100, receive_failed=True)
    assert parse_reply({"turnkv": reply.to_wire()}) == reply
    # What the connector has always sent: these four keys, under "turnkv".
    assert reply.to_wire() == {"held_blocks": 3, "local_tokens": 256, "received_tokens": 100,
                               "receive_failed": True}
    assert parse_reply(None) is None
    assert parse_reply({"remote_block_ids": [[1]]}) is None  # upstream's, streamed: none
    with pytest.raises(BadParams, match="object"):
        TurnReply.from_wire([1])
