"""`kv_transfer_params["turnkv"]`: what the router writes is what the connector reads."""

from __future__ import annotations

import pytest

from turnkv_server.connector.params import BadParams, Receive, Send, TurnParams, parse


def test_round_trip() -> None:
    params = TurnParams(session="s", ttl_s=30.0, priority=2,
                        receive=Receive("t-1", "127.0.0.1:5000", 99, 10.0), send=Send("t-2"))
    assert parse({"turnkv": params.to_wire()}) == params
    assert parse({"turnkv": TurnParams(release=True).to_wire()}) == TurnParams(release=True)


def test_other_connectors_params_are_not_ours() -> None:
    assert parse(None) is None
    assert parse({"do_remote_decode": True}) is None


@pytest.mark.parametrize(("raw", "field"), [
    ("nope", "turnkv must be an object"),
    ({"session": ""}, "session"),
    ({"session": 3}, "session"),
    ({"ttl_s": 0}, "ttl_s"),
    ({"ttl_s": True}, "ttl_s"),
    ({"priority": "high"}, "priority"),
    ({"release": "yes"}, "release"),
    ({"receive": {"transfer_id": "t", "peer": "nohost"}}, "peer"),
    ({"receive": {"transfer_id": "", "peer": "h:1"}}, "transfer_id"),
    ({"receive": {"transfer_id": "t", "peer": "h:1", "peer_tokens": -1}}, "peer_tokens"),
    ({"receive": {"transfer_id": "t", "peer": "h:1", "timeout_s": 0}}, "timeout_s"),
    ({"send": {"transfer_id": "a b"}}, "transfer_id"),
    ({"send": []}, "send"),
])
def test_malformed_params_name_the_field(raw: object, field: str) -> None:
    with pytest.raises(BadParams, match=field):
        parse({"turnkv": raw})
