"""The examples against the real router: the coding agent's loop and the copilot backend
(bidirectional, tiny model), and the demo's agent on SmolLM2 (turnkv).

The tiny model writes random tokens, so its tests check mechanics, not answers: turns run and
reuse their session's KV, a reply the agent cannot read is reported back and the loop goes
on, the hints reach the router, and the stats the examples show are the router's record. On
SmolLM2 the demo's answers themselves are checked.
"""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

import turnkv
from examples.agent import explain, sample
from examples.agent.loop import (
    Agent,
    AgentConfig,
    Answered,
    Event,
    QuestionStarted,
    Reported,
    ToolDone,
    ToolStarted,
    TurnDone,
    TurnStarted,
)
from examples.agent.tools import FolderTools
from examples.copilot_backend import create_app
from tests.support.cluster_pool import ClusterPool
from tests.support.clusters import SMOLLM2_TURNKV
from tests.support.reference import References
from turnkv_server.engine.metrics import fetch_connector_counters
from turnkv_server.launcher import ClusterState

DEFAULT_TTL = 300.0  # the router's default lease (turnkv_server.router.sessions.LeasePolicy)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "notes.md").write_text("# Notes\nThe router keeps a lease per session.\n")
    (tmp_path / "todo.txt").write_text("write the docs\nrun the tests\n")
    return tmp_path


def router_record(state: ClusterState, session_id: str) -> httpx.Response:
    return httpx.get(f"{state.router}/v1/turnkv/sessions/{session_id}", timeout=30)


def check_recorded(state: ClusterState, event: TurnDone) -> None:
    """What the agent shows for a turn is the router's record of it; the final turn ends the
    session on the router."""
    stats = event.turn.stats
    assert stats.served_by_turnkv and stats.turn == event.turn.index
    record = router_record(state, str(stats.session_id))
    if event.final:
        assert record.status_code == 404, "the final hint should have ended the session"
        return
    assert record.json()["turns"] == event.turn.index
    assert record.json()["last_turn"] == stats.wire().model_dump()
    if event.turn.index >= 2:
        # The system prompt and the worked example at least: read back (or, for a short delta
        # turnkv serves on the decode engine alone, held there), not recomputed.
        assert (stats.reused_tokens or 0) > 0, stats.prompt_tokens


def run_agent(state: ClusterState, folder: Path, config: AgentConfig,
              on_event: Any = None) -> tuple[Agent, list[Event]]:
    client = turnkv.OpenAI(base_url=f"{state.router}/v1", api_key="test")
    # keep=True: nothing but the agent's own `final` hint may end the session on the router.
    with client.session(keep=True) as session:
        agent = Agent(session, FolderTools(folder), config, folder_name=folder.name)
        events = []
        for event in agent.run():
            events.append(event)
            if isinstance(event, TurnDone):
                check_recorded(state, event)
            if on_event is not None:
                on_event(session, event)
    assert [t.index for t in session.turns] == list(range(1, agent.turns + 1))
    assert session.stats.turns == agent.turns and session.stats.prompt_tokens_reused > 0
    return agent, events


def test_unreadable_replies_are_reported_and_the_loop_goes_on(
    router_cluster: ClusterState, folder: Path
) -> None:
    config = AgentConfig(model=router_cluster.served_model_name,
                         questions=["What is in notes.md?", "Which file mentions tests?"],
                         max_turns=4, turns_per_question=2, max_tokens=8)
    agent, events = run_agent(router_cluster, folder, config)

    # Random tokens are neither a tool call nor an answer: every turn but the final one is
    # reported back, and the next turn still comes, with the report in its prompt.
    print([type(e).__name__ for e in events if type(e).__name__ != "TextDelta"])
    assert agent.turns == 4
    assert sum(isinstance(e, Reported) for e in events) == 3
    for i, event in enumerate(events):
        if isinstance(event, Reported):
            assert any(isinstance(e, TurnStarted) for e in events[i:])
    reports = [m for m in agent.messages if "could not read your reply" in str(m["content"])]
    assert len(reports) == 3
    assert [a.answer for a in events if isinstance(a, Answered)] == [None, None]
    assert [e.final for e in events if isinstance(e, TurnDone)] == [False, False, False, True]


def test_tool_calls_carry_next_turn_in_and_the_last_turn_final(
    router_cluster: ClusterState, folder: Path
) -> None:
    # Structured outputs hold even the tiny model to the format: its first reply is a tool
    # call, its second (the last, carrying `final`) an answer.
    config = AgentConfig(model=router_cluster.served_model_name,
                         questions=["What is in notes.md?"], max_turns=2,
                         turns_per_question=2, max_tokens=32, constrain=True,
                         tool_prior_s=400.0)
    leases: list[float] = []

    def before_tool(session: turnkv.Session, event: Event) -> None:
        if isinstance(event, ToolStarted):
            leases.append(router_record(router_cluster, session.id).json()["expires_in_s"])

    agent, events = run_agent(router_cluster, folder, config, before_tool)

    started = [e for e in events if isinstance(e, ToolStarted)]
    assert len(started) == 1 and started[0].next_turn_in == 400.0
    # The router extends the lease to 1.5x the announced pause (capped at 900 s): beyond its
    # default, which is all the session would have without the hint.
    assert len(leases) == 1 and DEFAULT_TTL < leases[0] <= 600.0
    done = next(e for e in events if isinstance(e, ToolDone))
    assert done.call.name in {"list_files", "read_file", "search"}
    asked = max(i for i, m in enumerate(agent.messages)
                if str(m["content"]).startswith("Question: "))  # past the worked example
    results = [m for m in agent.messages[asked:]
               if str(m["content"]).startswith(("Tool result (", "Tool error ("))]
    assert len(results) == 1 and done.call.describe() in results[0]["content"]
    answers = [e.answer for e in events if isinstance(e, Answered)]
    assert len(answers) == 1 and answers[0] is not None
    assert [e.final for e in events if isinstance(e, TurnDone)] == [False, True]


def test_copilot_backend_keeps_one_session_per_conversation(
    router_cluster: ClusterState,
) -> None:
    client = turnkv.AsyncOpenAI(base_url=f"{router_cluster.router}/v1", api_key="test")
    app = create_app(client, router_cluster.served_model_name, max_conversations=1)

    async def play() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://copilot",
                                     timeout=120) as http:
            replies = []
            for text in ["How do I read a file in Python?", "And how do I write one?"]:
                response = await http.post("/conversations/c1/messages",
                                           json={"content": text, "max_tokens": 8})
                assert response.status_code == 200, response.text
                replies.append(response.json())
            assert [r["turn"] for r in replies] == [1, 2]
            assert {r["session_id"] for r in replies} == {"copilot-c1"}
            record = router_record(router_cluster, "copilot-c1").json()
            assert record["turns"] == 2
            stats = turnkv.TurnStats.model_validate(replies[1]["stats"])
            assert record["last_turn"] == stats.wire().model_dump()
            assert (stats.prompt_tokens.prefill_reused or 0) > 0

            shown = (await http.get("/conversations/c1")).json()
            assert [m["role"] for m in shown["messages"]] == [
                "system", "user", "assistant", "user", "assistant"]
            assert shown["messages"][2]["content"] == replies[0]["reply"]

            # One conversation at most: opening another ends c1 and releases its session.
            other = await http.post("/conversations/c2/messages", json={"content": "hi",
                                                                        "max_tokens": 4})
            assert other.status_code == 200, other.text
            assert (await http.get("/conversations/c1")).status_code == 404
            assert router_record(router_cluster, "copilot-c1").status_code == 404

            ended = await http.delete("/conversations/c2")
            assert ended.json() == {"conversation_id": "c2", "released": True}
            assert router_record(router_cluster, "copilot-c2").status_code == 404
            assert (await http.delete("/conversations/c2")).status_code == 404
            bad = await http.post("/conversations/not%20valid/messages", json={"content": "x"})
            assert bad.status_code == 400

    asyncio.run(play())


@pytest.mark.cluster(SMOLLM2_TURNKV)
def test_the_demo_agent_answers_each_question_from_the_file_it_read(
    smollm2_references: References, clusters: ClusterPool
) -> None:
    """`make demo`'s agent, questions and sample project on SmolLM2 behind the turnkv connector
    (greedy: deterministic). Each answer holds its question's fact, a port number or a name
    the model cannot guess, and a tool result of that question showed it: the answer came from
    the file the agent read. The per-turn table fits 80 columns uncut.

    Runs on test_turnkv_connector.py's pair (whose reference engine, `smollm2_references`,
    comes and goes first), clean: every block it holds at the end is its own."""
    state = clusters.clean(SMOLLM2_TURNKV)[1]
    config = AgentConfig(model=state.served_model_name, questions=sample.QUESTIONS,
                         constrain=True)  # the demo's settings: its options' defaults
    started = time.monotonic()
    agent, events = run_agent(state, sample.FOLDER, config)
    print(f"demo agent: {agent.turns} turns in {time.monotonic() - started:.1f} s")

    results: dict[int, list[str]] = {}  # each question's tool results
    question = 0
    for event in events:
        if isinstance(event, QuestionStarted):
            question = event.index
        elif isinstance(event, ToolDone) and event.ok:
            results.setdefault(question, []).append(event.result)
        elif isinstance(event, TurnDone):
            print(f"turn {event.turn.index}: {event.turn.text!r}\n  "
                  f"{explain.turn_line(event.turn.stats)}")
    for index, (text, fact) in enumerate(sample.FACTS.items()):
        answer = agent.answers[index]
        print(f"{text} -> {answer!r}")
        assert answer is not None and fact.lower() in answer.lower(), (text, answer)
        assert any(fact in result for result in results.get(index, [])), (text, results)

    console = Console(file=io.StringIO(), width=80, record=True)
    console.print(turnkv.stats_table(agent.session.turns))
    table = console.export_text()
    assert "…" not in table and max(len(line) for line in table.splitlines()) <= 80, table

    # The final hint ended the session: both engines give every lease and block back.
    engines = [engine.url for engine in state.engines]
    deadline = time.monotonic() + 60
    while not all(c.get("pinned_blocks") == 0 and c.get("leases") == 0
                  and c.get("kv_cache_usage") == 0
                  for c in map(fetch_connector_counters, engines)):
        assert time.monotonic() < deadline, "blocks still held after the final turn"
        time.sleep(0.2)
