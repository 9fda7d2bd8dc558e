"""Session IDs, prefix IDs and hints: validated before anything is sent."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import openai
import pytest

import turnkv
from turnkv import protocol as p
from turnkv.tagging import tag_headers
from turnkv_server.router.app import extract_tag

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]


@pytest.fixture
def closed_port_client() -> turnkv.OpenAI:
    """A client whose server does not exist: anything sent fails with a connection error."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return turnkv.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"id": "has space"}, "turnkv.session_id"),
    ({"id": "-starts-with-dash"}, "turnkv.session_id"),
    ({"id": "x" * 129}, "turnkv.session_id"),
    ({"prefix_id": "bad/prefix"}, "turnkv.prefix_id"),
    ({"ttl": 0}, "turnkv.hints.ttl"),
    ({"ttl": 86401}, "turnkv.hints.ttl"),
    ({"priority": 11}, "turnkv.hints.priority"),
])
def test_bad_session_arguments_raise_before_sending(
    closed_port_client: turnkv.OpenAI, kwargs: dict[str, object], field: str
) -> None:
    for make in (closed_port_client.session, turnkv.session):
        with pytest.raises(turnkv.InvalidTagError) as err:
            make(**kwargs)  # type: ignore[arg-type]
        assert err.value.field == field and field in str(err.value)


@pytest.mark.parametrize(("hint", "field"), [
    ({"next_turn_in": -1}, "turnkv.hints.next_turn_in"),
    ({"priority": -11}, "turnkv.hints.priority"),
    ({"ttl": -5}, "turnkv.hints.ttl"),
])
def test_bad_hints_raise_before_sending_and_change_nothing(
    closed_port_client: turnkv.OpenAI, hint: dict[str, float], field: str
) -> None:
    session = closed_port_client.session(ttl=60, retry=turnkv.RetryPolicy(attempts=1))
    before = session.hints
    with pytest.raises(turnkv.InvalidTagError) as err:
        session.hint(**hint)  # type: ignore[arg-type]
    assert err.value.field == field
    assert session.hints == before
    # hint_now validates before it would POST to the (closed) server.
    with pytest.raises(turnkv.InvalidTagError):
        session.hint_now(**hint)  # type: ignore[arg-type]
    # Whereas a valid turn does reach for the network, and fails there.
    with pytest.raises(openai.APIConnectionError):
        session.chat(messages=MESSAGES, model="m")
    assert session.turn == 1 and session.turns == []


def test_hints_last_or_go_with_one_turn() -> None:
    session = turnkv.session("s1", ttl=30, priority=1)
    session.hint(next_turn_in=5, final=True, priority=3)
    assert session.hints == p.CacheHints(ttl=30, next_turn_in=5, final=True, priority=3)
    pending = session.begin_turn()
    assert pending.index == 1 and pending.hints.final
    # One-shot hints went with that turn; ttl and priority stay.
    assert session.hints == p.CacheHints(ttl=30, priority=3)
    # A turn that never got an answer gives its index and its one-shot hints back.
    pending.give_up()
    assert session.turn == 1 and session.hints.next_turn_in == 5


def test_headers_the_sdk_sends_parse_back_on_the_router() -> None:
    session = turnkv.session("agent-7", ttl=90, priority=-2, prefix_id="p-1")
    session.hint(next_turn_in=2.5, final=True)
    tag = session.tag()
    assert tag_headers(tag)[p.HEADER_FINAL] == "true"
    assert extract_tag({}, httpx.Headers(tag_headers(tag))) == tag


def test_prefix_id_is_the_stable_head_only() -> None:
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    pid = turnkv.prefix_id(model="m", messages=MESSAGES, tools=tools)
    assert p.is_valid_id(pid) and pid.startswith("p-") and len(pid) == 26
    longer = [*MESSAGES, {"role": "assistant", "content": "hello"}]
    assert turnkv.prefix_id(model="m", messages=longer, tools=tools) == pid
    # Key order and explicit nulls do not change the head.
    reordered = [{"content": "You are terse.", "role": "system", "name": None}]
    assert turnkv.prefix_id(model="m", messages=reordered, tools=tools) == pid
    assert turnkv.prefix_id(model="m", messages=MESSAGES) != pid
    assert turnkv.prefix_id(model="other", messages=MESSAGES, tools=tools) != pid
    edited = [{"role": "system", "content": "You are verbose."}, MESSAGES[1]]
    assert turnkv.prefix_id(model="m", messages=edited, tools=tools) != pid


def test_prefix_id_is_the_same_in_another_process() -> None:
    code = ("import turnkv; print(turnkv.prefix_id(model='m', messages=[{'role': 'system', "
            "'content': 'You are terse.'}, {'role': 'user', 'content': 'other'}]))")
    other = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env={"PYTHONHASHSEED": "123"}).stdout.strip()
    assert other == turnkv.prefix_id(model="m", messages=MESSAGES)


def test_random_session_ids_are_valid_and_distinct() -> None:
    ids = {turnkv.session().id for _ in range(50)}
    assert len(ids) == 50 and all(p.is_valid_id(i) for i in ids)


def test_every_public_name_resolves() -> None:
    for name in turnkv.__all__:
        assert getattr(turnkv, name) is not None, name


def test_ids_are_matched_whole() -> None:
    assert p.is_valid_id("abc-1.2:3")
    for bad in ("abc\n", "\nabc", "", "-abc", "a b", "x" * 129, "é"):
        assert not p.is_valid_id(bad), repr(bad)
