"""The coding agent's pure parts: its folder tools, the tool-call parser, the grammar, the hints
and what the demo prints about them."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import turnkv
from examples.agent import explain
from examples.agent.calls import grammar, key_words, parse_native, parse_text
from examples.agent.loop import ToolTimer, next_turn_hint
from examples.agent.tools import FolderTools, ToolError
from turnkv import protocol as p


@pytest.fixture
def tools(tmp_path: Path) -> FolderTools:
    (tmp_path / "a.md").write_text("".join(f"line {i} about leases\n" for i in range(1, 201)))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("nothing here\nLEASE in capitals\n")
    (tmp_path / ".hidden").write_text("lease")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2lease")
    (tmp_path.parent / "secret.txt").write_text("outside")
    return FolderTools(tmp_path, max_chars=200, max_hits=3)


def test_list_skips_hidden_and_binary_files(tools: FolderTools) -> None:
    assert tools.list_files() == "a.md\nsub/b.txt"
    assert tools.run("list_files", {"folder": "sub"}) == "sub/b.txt"


def test_read_is_bounded_and_says_where_to_read_on(tools: FolderTools) -> None:
    text = tools.read_file("a.md")
    assert len(text) < 260 and text.startswith("line 1 about leases\nline 2 about leases")
    last_shown = int(text.splitlines()[-2].split()[1])
    assert text.splitlines()[-1] == (f"[{200 - last_shown} more lines: read on from line "
                                     f"{last_shown + 1}]")
    assert tools.run("read_file", {"path": "a.md", "line": "200"}) == "line 200 about leases"


@pytest.mark.parametrize(("args", "message"), [
    ({"path": "missing.md"}, "no file 'missing.md'; files here: a.md, sub/b.txt"),
    ({"path": "../secret.txt"}, "outside the folder"),
    ({"path": "a.md", "line": "900"}, "line 900 is out of range"),
    ({"path": "a.md", "line": "x"}, "line must be a number"),
    ({}, "read_file needs path"),
    ({"path": "a.md", "mode": "w"}, "not mode"),
])
def test_bad_reads_are_tool_errors(tools: FolderTools, args: dict[str, object],
                                   message: str) -> None:
    with pytest.raises(ToolError, match=re.escape(message)):
        tools.run("read_file", args)


def test_search_is_case_insensitive_bounded_and_takes_broken_regexes_literally(
    tools: FolderTools,
) -> None:
    hits = tools.search("LEASE").splitlines()
    assert hits[:3] == ["a.md:1: line 1 about leases", "a.md:2: line 2 about leases",
                        "a.md:3: line 3 about leases"]
    assert hits[3] == "... 198 more matches"
    assert tools.search("capitals(") == "no line matches 'capitals('"
    assert tools.search("in capitals") == "sub/b.txt:2: LEASE in capitals"


@pytest.mark.parametrize(("reply", "name", "args"), [
    ("CALL read_file protocol.md", "read_file", {"path": "protocol.md"}),
    ("CALL read_file protocol.md  shows the lines", "read_file", {"path": "protocol.md"}),
    ("CALL read_file a.md 40", "read_file", {"path": "a.md", "line": "40"}),
    ("Sure!\n`CALL search lease`\nCALL search other", "search", {"pattern": "lease"}),
    ("call: list_files .", "list_files", {"folder": "."}),
    ('CALL read_file("a.md", 3)', "read_file", {"path": "a.md", "line": "3"}),
    ("CALL search 'prefix cache'", "search", {"pattern": "prefix cache"}),
    ('I will look.\n{"tool": "read_file", "args": {"path": "x.md"}}', "read_file",
     {"path": "x.md"}),
])
def test_calls_are_read_leniently(tools: FolderTools, reply: str, name: str,
                                  args: dict[str, object]) -> None:
    parsed = parse_text(reply, tools.specs)
    assert parsed.problem is None and parsed.answer is None
    assert [(c.name, c.args) for c in parsed.calls] == [(name, args)]


def test_the_first_directive_wins_and_answers_keep_their_lines(tools: FolderTools) -> None:
    assert parse_text("ANSWER: two\nlines\nCALL search x", tools.specs).answer == (
        "two\nlines\nCALL search x")
    assert parse_text("CALL search x\nANSWER: no", tools.specs).calls[0].args == {
        "pattern": "x"}


@pytest.mark.parametrize(("reply", "problem"), [
    ("The files are a.md and b.md.", "no CALL line and no ANSWER: line"),
    ("CALL delete_everything now", "unknown tool 'delete_everything'"),
    ("CALL", "names no tool"),
    ("ANSWER:", "the ANSWER: line is empty"),
    ('{"tool": "rm", "args": {}}', "unknown tool 'rm'"),
])
def test_unreadable_replies_name_the_problem(tools: FolderTools, reply: str,
                                             problem: str) -> None:
    parsed = parse_text(reply, tools.specs)
    assert not parsed.calls and parsed.answer is None
    assert parsed.problem is not None and problem in parsed.problem


def _native(content: str | None, *calls: tuple[str, str]) -> SimpleNamespace:
    tool_calls = [SimpleNamespace(id=f"call-{i}", function=SimpleNamespace(name=n, arguments=a))
                  for i, (n, a) in enumerate(calls)]
    return SimpleNamespace(content=content, tool_calls=tool_calls or None)


def test_native_tool_calls(tools: FolderTools) -> None:
    parsed = parse_native(_native(None, ("read_file", '{"path": "a.md"}'),
                                  ("search", "{oops"), ("rm", "{}")), tools.specs)
    assert [(c.name, c.call_id, c.problem is None) for c in parsed.calls] == [
        ("read_file", "call-0", True), ("search", "call-1", False), ("rm", "call-2", False)]
    assert "not valid JSON" in str(parsed.calls[1].problem)
    # Without tool_calls, prose is the answer; a textual call is still honoured.
    assert parse_native(_native("It is in a.md."), tools.specs).answer == "It is in a.md."
    assert parse_native(_native("CALL search x"), tools.specs).calls[0].name == "search"


def test_grammar_admits_exactly_the_format(tools: FolderTools) -> None:
    files, words = ["a.md", "sub/b.txt"], key_words("Where is the lease of a session renewed?")
    assert words == ["lease", "session", "renewed"]
    free = grammar(tools.specs, files, words, must_call=False, must_answer=False)
    for good in ["CALL read_file a.md", "CALL read_file sub/b.txt", "CALL search lease",
                 "CALL list_files .", "ANSWER: it is in a.md"]:
        assert re.fullmatch(free, good), good
    for bad in ["CALL read_file c.md", "CALL read_file a.md 12", "CALL search where",
                "ANSWER: 1: 1: 1:",
                "CALL list_files sub", "CALL rm a.md", "hello", "ANSWER: two\nlines"]:
        assert not re.fullmatch(free, bad), bad
    must_call = grammar(tools.specs, files, words, must_call=True, must_answer=False)
    assert re.fullmatch(must_call, "CALL search session")
    assert not re.fullmatch(must_call, "CALL list_files .")
    assert not re.fullmatch(must_call, "ANSWER: x")
    must_answer = grammar(tools.specs, files, words, must_call=False, must_answer=True)
    assert re.fullmatch(must_answer, "ANSWER: it is")
    assert not re.fullmatch(must_answer, "CALL search lease")
    # No usable words: any word may be searched for.
    assert re.fullmatch(grammar(tools.specs, files, [], must_call=True, must_answer=False),
                        "CALL search anything")


def test_tool_timer_starts_from_the_prior_then_follows_measurements() -> None:
    timer = ToolTimer(prior_s=2.0)
    assert timer.estimate("search") == 2.0
    timer.record("search", 1.0)
    assert timer.estimate("search") == 1.0
    timer.record("search", 2.0)
    assert timer.estimate("search") == pytest.approx(1.3)
    assert timer.estimate("read_file") == 2.0


@pytest.mark.parametrize(("tool_s", "hint"), [(0.0003, 1.0), (1.0, 1.0), (1.2, 2.0),
                                               (400.0, 400.0)])
def test_the_next_turn_hint_is_whole_seconds_and_at_least_one(tool_s: float,
                                                               hint: float) -> None:
    assert next_turn_hint(tool_s) == hint


def test_hints_and_durations_read_in_sane_units() -> None:
    assert explain.hint(1.0, "read_file") == (
        "told the router: next turn in ~1 s, after read_file runs (so it keeps the "
        "session's cache at least that long)")
    assert [explain.duration(s) for s in (0.0003, 0.0123, 0.5, 2.0, 90.0)] == [
        "under 1 ms", "12.3 ms", "500 ms", "2 s", "90 s"]


def turn_stats(turn: int, total: int, computed: int, **extra: object) -> turnkv.TurnStats:
    wire = p.RouterTurnStats(
        session_id="s", turn=turn, mode="turnkv", prefill_node="prefill-0",
        decode_node="decode-0", completion_tokens=10,
        prompt_tokens=p.PromptTokens(total=total, prefill_computed=computed,
                                                   prefill_reused=total - computed),
        **extra)  # type: ignore[arg-type]
    return turnkv.TurnStats.from_wire(wire, client_ttft_ms=412.0)


def test_a_turn_line_says_where_the_prompt_came_from() -> None:
    assert explain.turn_line(turn_stats(2, 1_900, 140)) == (
        "first token after 412 ms; prompt 1,900 tokens: 1,760 reused from cache, 140 computed")
    alone = turn_stats(3, 1_950, 0).model_copy(update={"prefill_node": None})
    assert "the decode engine computed it alone" in explain.turn_line(alone)
    assert explain.prefix_break(turn_stats(2, 1_900, 140), None) is None


def test_a_prefix_break_is_explained_with_its_cause_and_cost() -> None:
    previous = turn_stats(3, 1_600, 100)
    in_reply = explain.prefix_break(turn_stats(4, 1_900, 259, prefix_break_at=1_641), previous)
    assert in_reply is not None
    assert in_reply.startswith("prefix break at token 1,641 of 1,900: from there on, the prompt "
                               "differs from the history the engines hold")
    assert "It is inside the model's last reply" in in_reply
    assert in_reply.endswith("the 259 tokens after it had to be computed.")
    earlier = explain.prefix_break(turn_stats(4, 1_900, 1_700, prefix_break_at=200), previous)
    assert earlier is not None and "an earlier message changed" in earlier
    unknown = explain.prefix_break(turn_stats(1, 900, 700, prefix_break_at=200), None)
    assert unknown is not None and "  " not in unknown and "It is" not in unknown
