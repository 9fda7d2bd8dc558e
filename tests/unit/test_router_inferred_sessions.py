"""Conversations nobody tagged become sessions (`turnkv_server.router.inferred_sessions`, on
the digests of `conversations`): one session per conversation, never two conversations in
one, a branch or an edit a fork of its own. First as pure logic, clients played turn by turn
against the table; then through the router in front of stand-in engines.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_router_affinity import StandIn, affinity_router
from turnkv_server.router.conversations import (
    CHAT_PATH,
    RelayedReply,
    canonical,
    prompt_digests,
)
from turnkv_server.router.inferred_sessions import INFERRED_PREFIX, InferredSessions
from turnkv_server.router.sessions import SessionKey

LONG_SYSTEM = "You are a careful assistant for a storage team. " * 40


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(max_entries: int = 1000, max_age_s: float = 900.0) -> InferredSessions:
    return InferredSessions(max_entries, max_age_s, Clock())


@dataclass
class Client:
    """A stock client's conversation: the whole history every turn, the reply appended."""

    tenant: str = "t"
    messages: list[dict[str, Any]] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)

    def ask(self, inferred: InferredSessions, text: str, reply: str,
            served: bool = True) -> str:
        """One turn: `text` asked, answered `reply` (or failed, `served` False)."""
        request = [*self.messages, {"role": "user", "content": text}]
        digests = prompt_digests({"model": "m", "messages": request}, self.tenant)
        assert digests is not None
        found = inferred.infer(self.tenant, digests, None)
        key = SessionKey(self.tenant, found.session_id)
        self.sessions.append(found.session_id)
        self.outcomes.append(found.outcome)
        if not served:
            inferred.abandon(key)
            return found.session_id
        answer = {"role": "assistant", "content": reply}
        inferred.served(key, answer)
        self.messages = [*request, answer]
        return found.session_id


def system(text: str = LONG_SYSTEM) -> list[dict[str, Any]]:
    return [{"role": "system", "content": text}]


def test_conversations_at_once_are_one_session_each_and_a_shared_prompt_glues_none() -> None:
    inferred = table()
    # Two share the long system prompt, and even their first question; a third shares the
    # prompt only; a fourth has none.
    clients = [Client(messages=system()), Client(messages=system()),
               Client(messages=system()), Client()]
    first = ["How do I back up?", "How do I back up?", "What is fsync?", "hello"]
    for turn in range(5):
        for number, client in enumerate(clients):
            question = first[number] if turn == 0 else f"follow-up {turn} of {number}"
            # Each conversation's engine answered in its own words.
            client.ask(inferred, question, f"answer {turn} to conversation {number}")
    for client in clients:
        assert len(set(client.sessions)) == 1, client.sessions
        assert client.outcomes == ["new"] + ["continued"] * 4
        assert client.sessions[0].startswith(INFERRED_PREFIX)
    assert len({c.sessions[0] for c in clients}) == len(clients)


def test_a_branch_is_a_fork_and_never_changes_the_first_continuation() -> None:
    inferred = table()
    trunk = Client(messages=system())
    trunk.ask(inferred, "Plan the migration.", "Step one: copy.")
    trunk.ask(inferred, "And then?", "Step two: verify.")
    # Two continuations of one history: the first comes and continues the session, the
    # second (the history before the first's reply) forks.
    branch = Client(messages=list(trunk.messages))
    session = trunk.ask(inferred, "Go on.", "Step three: switch.")
    forked = branch.ask(inferred, "Instead, roll back?", "Rolling back: restore.")
    assert forked != session and branch.outcomes == ["forked"]
    for turn in range(3):
        assert trunk.ask(inferred, f"trunk {turn}", f"t{turn}") == session
        assert branch.ask(inferred, f"branch {turn}", f"b{turn}") == forked
    # A fork is placed where its parent's KV is: the parent's prefix.
    digests = prompt_digests({"model": "m", "messages": [
        *trunk.messages[:5], {"role": "user", "content": "third branch"}]}, "t")
    assert digests is not None
    third = inferred.infer("t", digests, None)
    assert third.outcome == "forked" and third.prefix_id == session


def test_a_continuation_while_a_turn_of_the_session_is_in_flight_forks() -> None:
    inferred = table()
    client = Client()
    session = client.ask(inferred, "q1", "a1")
    request = [*client.messages, {"role": "user", "content": "q2"}]
    digests = prompt_digests({"model": "m", "messages": request}, "t")
    assert digests is not None
    assert inferred.infer("t", digests, None).session_id == session  # in flight now
    duplicate = inferred.infer("t", digests, None)  # the same turn again, at once
    assert duplicate.outcome == "forked" and duplicate.session_id != session


def test_a_turns_end_told_after_the_next_turn_began_changes_nothing() -> None:
    """A streamed turn's relay ends (and says so) after the client has its last chunk, so the
    conversation's next turn can begin first: the late word of the served turn must not end
    the next turn's, which would leave its boundary unkept and fork the turn after it."""
    inferred = table()
    turn = 0

    def ask(messages: list[dict[str, Any]]) -> tuple[SessionKey, int, str]:
        nonlocal turn
        turn += 1
        request = [*messages, {"role": "user", "content": f"q{turn}"}]
        found = inferred.infer_turn(CHAT_PATH, {"model": "m", "messages": request}, "t", None)
        assert found is not None
        tag, ticket = found
        return SessionKey("t", tag.session_id), ticket, tag.session_id

    messages: list[dict[str, Any]] = []
    key, first, session = ask(messages)
    inferred.served(key, {"role": "assistant", "content": "a1"}, first)
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    key, second, again = ask(messages)
    assert again == session
    inferred.abandon(key, first)  # the first turn's relay, ending late
    inferred.served(key, {"role": "assistant", "content": "a2"}, second)
    messages += [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    _, _, third = ask(messages)
    assert third == session


def test_an_edit_mid_way_forks_and_the_edited_conversation_stays_in_its_fork() -> None:
    inferred = table()
    client = Client(messages=system())
    session = client.ask(inferred, "Summarise the incident.", "Disk full at 02:00.")
    client.ask(inferred, "Why?", "Logs were not rotated.")
    client.ask(inferred, "Fix?", "Rotate daily.")
    # The client rewrites its second question (its reply kept): the history departs after
    # the first reply, an older boundary of the session.
    client.messages[3] = {"role": "user", "content": "Why, in one line?"}
    edited = client.ask(inferred, "Anything else?", "Alert at 80%.")
    assert edited != session and client.outcomes[-1] == "forked"
    for turn in range(3):
        assert client.ask(inferred, f"more {turn}", f"r{turn}") == edited
    # An edit before any reply of it matches nothing: a new conversation.
    other = Client(messages=system())
    other.ask(inferred, "Summarise the incident, please.", "Disk full.")
    assert other.outcomes == ["new"]


def test_a_failed_turn_leaves_the_conversation_where_it_was() -> None:
    inferred = table()
    client = Client()
    session = client.ask(inferred, "q1", "a1")
    assert client.ask(inferred, "q2", "", served=False) == session
    assert client.ask(inferred, "q2", "a2") == session  # the client's retry
    assert client.outcomes == ["new", "continued", "continued"]


def test_tenants_never_continue_each_others_conversations() -> None:
    inferred = table()
    a, b = Client(tenant="a"), Client(tenant="b")
    a_session = a.ask(inferred, "same question", "same answer")
    b_session = b.ask(inferred, "same question", "same answer")
    # Tenant b's history is tenant a's, word for word: its own session still.
    assert b.ask(inferred, "next", "x") == b_session != a_session
    assert a.ask(inferred, "next", "y") == a_session


def test_the_tables_are_bounded_by_count_and_by_age() -> None:
    clock = Clock()
    inferred = InferredSessions(max_entries=3, max_age_s=60.0, clock=clock)
    clients = [Client() for _ in range(5)]
    for number, client in enumerate(clients):
        client.ask(inferred, f"q{number}", f"a{number}")
    assert len(inferred) == 3

    def continues(client: Client) -> bool:
        request = [*client.messages, {"role": "user", "content": "again"}]
        digests = prompt_digests({"model": "m", "messages": request}, "t")
        assert digests is not None
        found = inferred.infer("t", digests, None)
        inferred.abandon(SessionKey("t", found.session_id))
        return found.outcome == "continued"

    # The two oldest conversations were forgotten: their next turns would open new sessions.
    assert [continues(c) for c in clients] == [False, False, True, True, True]
    clock.now += 61
    assert not continues(clients[4])
    assert len(inferred) == 0


def test_the_canonical_form_survives_how_clients_echo_a_reply() -> None:
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "search", "arguments": '{"q": "fsync", "k": 3}'}}
    relayed = RelayedReply.of_response({"choices": [{"message": {
        "role": "assistant", "content": None, "tool_calls": [call],
        "reasoning_content": "let me think"}}]}).message()
    assert relayed is not None
    echoes = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "assistant", "content": "", "refusal": None, "audio": None,
         "annotations": [], "tool_calls": [{**call, "id": "call_renamed"}]},
        {"role": "assistant", "content": [], "tool_calls": [{"type": "function", "function": {
            "name": "search", "arguments": '{"k":3,"q":"fsync"}'}}]},
    ]
    for echo in echoes:
        assert canonical(echo) == canonical(relayed), echo
    streamed = RelayedReply()
    for delta in ({"role": "assistant", "content": ""},
                  {"tool_calls": [{"index": 0, "id": "x", "function": {"name": "search",
                                                                       "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"q": "fsync",'}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ' "k": 3}'}}]}):
        streamed.feed({"choices": [{"index": 0, "delta": delta}]})
    assert canonical(streamed.message() or {}) == canonical(relayed)
    # Text: parts or a string, surrounding blanks aside, are one message; other words are not.
    text = {"role": "assistant", "content": " Step one. "}
    assert canonical(text) == canonical({"role": "assistant", "content": [
        {"type": "text", "text": "Step one."}]})
    assert canonical(text) != canonical({"role": "assistant", "content": "Step two."})
    assert RelayedReply().message() is None  # no choice came: no reply to remember


def test_what_renders_the_conversation_is_part_of_it() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"}]

    def last_boundary(**extra: Any) -> bytes:
        digests = prompt_digests({"model": "m", "messages": messages, **extra}, "t")
        assert digests is not None
        return digests.boundaries[0]

    plain = last_boundary()
    assert last_boundary(temperature=0.9, max_tokens=5) == plain  # sampling renders nothing
    for other in ({"model": "other"}, {"tools": [{"type": "function"}]},
                  {"chat_template_kwargs": {"enable_thinking": True}}, {"cache_salt": "s"}):
        assert last_boundary(**other) != plain, other
    assert prompt_digests({"prompt": "text"}, "t") is None
    assert prompt_digests({"messages": ["not a message"]}, "t") is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=12)
FIELD = st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name"])


@settings(max_examples=300, deadline=None)
@given(messages=st.lists(st.dictionaries(FIELD, JSON) | JSON, max_size=4) | JSON,
       tools=JSON, model=JSON)
def test_any_request_is_read_or_left_alone_never_a_crash(messages: Any, tools: Any,
                                                         model: Any) -> None:
    """Whatever a client sends as messages (the engine judges it), the digests either read
    it or leave it to a one-off turn: no request fails on the router's account."""
    body = {"messages": messages, "tools": tools, "model": model}
    digests = prompt_digests(body, "t")
    if digests is not None:
        assert len(digests.prompt) == 16


# -- any interleaving ------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(
    ["ask", "branch", "edit", "fail", "twice"]), st.integers(0, 2), st.integers(0, 1)),
    max_size=40))
def test_a_session_is_continued_only_by_the_history_it_served(
        steps: list[tuple[int, str, int, int]]) -> None:
    """Four clients over a tiny vocabulary (so that histories collide), branching, editing,
    failing: whenever a turn continues a session, that session's last served prompt and
    reply are exactly the turn's history up to its last reply, and no session ever has two
    turns in flight."""
    inferred = table(max_entries=16)
    clients = [Client(messages=system("shared")) for _ in range(4)]
    served: dict[str, list[dict[str, Any]]] = {}  # session -> its last prompt and reply
    for who, action, word, answer in steps:
        client = clients[who]
        if action == "branch":
            clients[who] = client = Client(messages=list(clients[(who + 1) % 4].messages))
        elif action == "edit" and len(client.messages) > 2:
            client.messages[1] = {"role": "user", "content": f"edited {word}"}
        request = [*client.messages, {"role": "user", "content": f"w{word}"}]
        digests = prompt_digests({"model": "m", "messages": request}, "t")
        assert digests is not None
        found = inferred.infer("t", digests, None)
        if found.outcome == "continued":
            history = served[found.session_id]
            assert request[:len(history)] == history and \
                [m["role"] for m in request[len(history):]] == ["user"]
        key = SessionKey("t", found.session_id)
        if action == "twice":  # the same turn again while the first is in flight
            again = inferred.infer("t", digests, None)
            assert again.session_id != found.session_id and again.outcome != "continued"
            inferred.abandon(SessionKey("t", again.session_id))
        if action == "fail":
            inferred.abandon(key)
            continue
        reply = {"role": "assistant", "content": f"r{answer}"}
        inferred.served(key, reply)
        client.messages = [*request, reply]
        served[found.session_id] = list(client.messages)  # (edits change the client's)
        assert len(inferred) <= 16


# -- through the router ----------------------------------------------------------------------


def stats_of(reply: httpx.Response, stream: bool) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    if not stream:
        return dict(reply.json()["turnkv"])
    events = [orjson.loads(line[6:]) for line in reply.text.splitlines()
              if line.startswith("data: {")]
    return dict(next(e["turnkv"] for e in events if "turnkv" in e))


@pytest.mark.parametrize("stream", [False, True])
def test_untagged_conversations_through_the_router_are_one_session_each(stream: bool) -> None:
    async def main() -> None:
        engines = [StandIn(), StandIn()]
        async with affinity_router(engines) as (router, url), \
                httpx.AsyncClient(timeout=30) as client:
            conversations: list[list[dict[str, Any]]] = [
                system(), system(), [{"role": "system", "content": "Be brief."}]]
            sessions: list[set[str]] = [set() for _ in conversations]
            for turn in range(1, 4):
                for number, messages in enumerate(conversations):
                    messages.append({"role": "user", "content": f"turn {turn} of {number}"})
                    body: dict[str, Any] = {"model": "m", "messages": messages, "stream": stream}
                    if stream:  # (asks for the stats, in the usage chunk)
                        body["stream_options"] = {"include_usage": True}
                    stats = stats_of(await client.post(f"{url}/v1/chat/completions",
                                                       json=body), stream)
                    assert stats["session_source"] == "inferred"
                    assert stats["turn"] == turn, stats
                    sessions[number].add(stats["session_id"])
                    # The stand-in answers "a b", streamed or not, as the client keeps it.
                    messages.append({"role": "assistant", "content": "a b"})
            assert all(len(s) == 1 for s in sessions)
            assert len(set.union(*sessions)) == 3
            homes = {router.sessions.table.get(SessionKey("default", next(iter(s)))).decode
                     for s in sessions}
            assert homes == {"engine-0", "engine-1"}  # spread, each on its engine
            # Untagged turns of conversations: no stats chunk reached the engines' requests.
            assert not any("turnkv" in body for e in engines for body in e.seen)
    asyncio.run(main())


def test_a_router_that_infers_nothing_serves_one_off_turns() -> None:
    async def main() -> None:
        async with affinity_router([StandIn()], no_inferred_sessions=True) as (_, url), \
                httpx.AsyncClient(timeout=30) as client:
            reply = await client.post(f"{url}/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}]})
            stats = stats_of(reply, stream=False)
            assert stats["session_id"] is None and stats["session_source"] is None
    asyncio.run(main())
