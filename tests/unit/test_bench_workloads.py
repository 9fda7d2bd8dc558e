"""Benchmark workloads: determinism, sizes within their ranges, presets, and traces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from turnkv_server.bench.corpus import Corpus, load_corpus
from turnkv_server.bench.presets import PRESETS, PRESSURE, build_workload, preset_params
from turnkv_server.bench.prompts import TOOL_SCHEMAS
from turnkv_server.bench.sizing import MESSAGE_OVERHEAD_TOKENS, approx_tokens, take_tokens
from turnkv_server.bench.trace import TraceError, load_trace, write_trace
from turnkv_server.bench.workloads import (
    SessionSpec,
    Workload,
    WorkloadParams,
    generate,
    total_context_tokens,
)

TINY_MODEL_POSITIONS = 4096  # models/tiny.py max_position_embeddings


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus()


def agent_params(**overrides: object) -> WorkloadParams:
    fields: dict[str, object] = dict(name="t", kind="agent", seed=7, sessions=6, concurrency=3,
                                     turns=(5, 12), system_tokens=1500)
    fields.update(overrides)
    return WorkloadParams.model_validate(fields)


def session_context(s: SessionSpec) -> int:
    head = approx_tokens(s.system) + MESSAGE_OVERHEAD_TOKENS
    return head + sum(approx_tokens(t.user) + t.max_tokens + 2 * MESSAGE_OVERHEAD_TOKENS
                      for t in s.turns)


# --- determinism -------------------------------------------------------------------------

def test_same_seed_gives_identical_workload_json(corpus: Corpus) -> None:
    # A freshly loaded corpus too: nothing may depend on state left by an earlier run.
    for name in ("agent", "chat", "memory-pressure"):
        a = build_workload(name, seed=3, corpus=corpus, sessions=4, kv_cache_tokens=2500)
        b = build_workload(name, seed=3, corpus=load_corpus(), sessions=4, kv_cache_tokens=2500)
        assert a.model_dump_json() == b.model_dump_json()


def test_different_seed_gives_different_workload(corpus: Corpus) -> None:
    a = generate(agent_params(seed=1), corpus=corpus)
    b = generate(agent_params(seed=2), corpus=corpus)
    assert a.model_dump_json() != b.model_dump_json()
    assert [s.turns for s in a.sessions] != [s.turns for s in b.sessions]


def test_more_sessions_leave_the_first_ones_unchanged(corpus: Corpus) -> None:
    few = generate(agent_params(sessions=2, arrival_rate=1.0, concurrency=None), corpus=corpus)
    many = generate(agent_params(sessions=5, arrival_rate=1.0, concurrency=None), corpus=corpus)
    assert many.sessions[:2] == few.sessions


# --- sizes ---------------------------------------------------------------------------------

def test_agent_sizes_stay_within_their_ranges(corpus: Corpus) -> None:
    p = agent_params(sessions=8, tool_result_tokens=(100, 2000), output_tokens=(16, 64),
                     user_tokens=(20, 120), think_time_scale=2.5, think_time_max_s=10.0)
    w = generate(p, corpus=corpus)
    assert len(w.sessions) == 8 and w.kind == "agent" and w.concurrency == 3
    roles = set()
    for s in w.sessions:
        assert approx_tokens(s.system) == 1500
        assert s.tools == list(TOOL_SCHEMAS[:6])
        assert 5 <= len(s.turns) <= 12
        assert s.turns[0].role == "user" and s.turns[0].think_time_s == 0.0
        for t in s.turns:
            roles.add(t.role)
            lo, hi = p.tool_result_tokens if t.role == "tool" else p.user_tokens
            assert lo <= approx_tokens(t.user) <= hi
            assert 16 <= t.max_tokens <= 64
            assert 0.0 <= t.think_time_s <= 10.0 * 2.5
    assert roles == {"user", "tool"}


def test_tool_results_are_heavy_tailed_and_clipped(corpus: Corpus) -> None:
    w = generate(agent_params(sessions=10, turns=(20, 20), follow_up_prob=0.0), corpus=corpus)
    sizes = sorted(approx_tokens(t.user) for s in w.sessions for t in s.turns[1:])
    median = sizes[len(sizes) // 2]
    assert sizes[0] >= 100 and sizes[-1] <= 2000
    # A lognormal with median 350 and sigma 0.9: the largest results are several medians long.
    assert 200 <= median <= 550
    assert sizes[-1] >= 3 * median


def test_tool_results_look_like_tool_outputs(corpus: Corpus) -> None:
    w = generate(agent_params(sessions=8, follow_up_prob=0.0), corpus=corpus)
    firsts = {t.user.split(" ", 1)[0] for s in w.sessions for t in s.turns if t.role == "tool"}
    assert firsts == {"list_files", "read_file", "search"}
    reads = [t.user for s in w.sessions for t in s.turns if t.user.startswith("read_file")]
    # An excerpt: a header naming the file, then numbered lines.
    assert reads[0].splitlines()[1].split()[0].isdigit()


def test_sessions_end_early_rather_than_outgrow_the_context(corpus: Corpus) -> None:
    w = generate(agent_params(sessions=6, turns=(30, 40), max_context_tokens=4000),
                 corpus=corpus)
    for s in w.sessions:
        assert session_context(s) <= 4000
        assert len(s.turns) < 30


def test_context_limit_below_the_system_prompt_is_an_error(corpus: Corpus) -> None:
    with pytest.raises(ValueError, match="no room for a first turn"):
        generate(agent_params(max_context_tokens=1520), corpus=corpus)


def test_think_time_scale_multiplies_think_times(corpus: Corpus) -> None:
    one = generate(agent_params(), corpus=corpus)
    four = generate(agent_params(think_time_scale=4.0), corpus=corpus)
    for s1, s4 in zip(one.sessions, four.sessions, strict=True):
        assert [t.user for t in s1.turns] == [t.user for t in s4.turns]
        for t1, t4 in zip(s1.turns, s4.turns, strict=True):
            assert t4.think_time_s == pytest.approx(4 * t1.think_time_s, abs=0.003)


def test_poisson_arrivals_and_closed_loop_starts(corpus: Corpus) -> None:
    open_loop = generate(agent_params(sessions=20, turns=(5, 5), concurrency=None,
                                      arrival_rate=2.0), corpus=corpus)
    starts = [s.start_s for s in open_loop.sessions]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0
    assert open_loop.concurrency is None
    closed = generate(agent_params(), corpus=corpus)
    assert {s.start_s for s in closed.sessions} == {0.0}


def test_chat_sessions_are_short_user_turns(corpus: Corpus) -> None:
    p = preset_params("chat", seed=5)
    w = generate(p, corpus=corpus)
    assert w.kind == "chat"
    for s in w.sessions:
        assert s.tools is None
        assert 3 <= len(s.turns) <= 12
        for t in s.turns:
            assert t.role == "user" and 8 <= approx_tokens(t.user) <= 60
            assert 32 <= t.max_tokens <= 128
        # People take seconds between turns.
        assert all(0.5 <= t.think_time_s <= 30.0 for t in s.turns[1:])


# --- presets -------------------------------------------------------------------------------

def test_every_preset_builds(corpus: Corpus) -> None:
    for name in PRESETS:
        w = build_workload(name, corpus=corpus, kv_cache_tokens=8000)
        assert w.name == name and w.sessions


def test_smoke_fits_the_tiny_model_with_a_dense_tokenizer(corpus: Corpus) -> None:
    # The tiny model's byte-level BPE makes about 3.3 characters a token of this text; sized
    # at 2.5, the smoke sessions must still build and fit in half its 4,096 positions.
    def dense(text: str) -> int:
        return math.ceil(len(text) / 2.5)

    w = build_workload("smoke", corpus=corpus, count_tokens=dense)
    assert len(w.sessions) == 2 and [len(s.turns) for s in w.sessions] == [3, 3]
    for s in w.sessions:
        chars = len(s.system) + sum(len(t.user) for t in s.turns)
        outputs = sum(t.max_tokens for t in s.turns)
        assert dense(" " * chars) + outputs < TINY_MODEL_POSITIONS // 2


def test_memory_pressure_just_exceeds_the_cache(corpus: Corpus) -> None:
    w = build_workload("memory-pressure", corpus=corpus, kv_cache_tokens=8000, pressure=1.5)
    assert total_context_tokens(w) > 1.5 * 8000
    fewer = w.model_copy(update={"sessions": w.sessions[:-1]})
    assert total_context_tokens(fewer) <= 1.5 * 8000
    # Long tool time: seconds between turns, so LRU eviction takes sessions' blocks.
    thinks = sorted(t.think_time_s for s in w.sessions for t in s.turns[1:])
    assert thinks[len(thinks) // 2] >= 1.0
    assert w.concurrency is None and w.sessions[-1].start_s > 0


def test_agent_pressure_has_room_long_histories_small_deltas_heavy_tailed_tools(
        corpus: Corpus) -> None:
    cache, factor = PRESSURE["agent-pressure"].cache_tokens, PRESSURE["agent-pressure"].factor
    # Three times what a pair of engines holds together.
    assert factor == 6.0
    w = build_workload("agent-pressure", corpus=corpus)
    assert total_context_tokens(w) > factor * cache
    fewer = w.model_copy(update={"sessions": w.sessions[:-1]})
    assert total_context_tokens(fewer) <= factor * cache
    for s in w.sessions:
        # Several thousand tokens of own history by the end, within one engine's cache.
        assert 2000 < session_context(s) <= cache
        # Each later turn adds a few hundred tokens.
        assert all(100 <= approx_tokens(t.user) <= 1000 for t in s.turns[1:])
    thinks = sorted(t.think_time_s for s in w.sessions for t in s.turns[1:])
    median = thinks[len(thinks) // 2]
    assert 2.0 <= median <= 8.0 and thinks[-1] <= 60.0
    assert thinks[0] < median / 3 and thinks[-1] > 3 * median
    # All sessions live at once: the last starts long before the first could end.
    assert w.concurrency is None and w.sessions[-1].start_s < 30.0


def test_memory_pressure_that_cannot_be_reached_is_an_error(corpus: Corpus) -> None:
    with pytest.raises(ValueError, match="fewer than"):
        build_workload("memory-pressure", corpus=corpus, kv_cache_tokens=8000, sessions=2)


def test_total_context_counts_a_shared_system_prompt_once(corpus: Corpus) -> None:
    w = generate(agent_params(sessions=3), corpus=corpus)
    per_session = sum(session_context(s) for s in w.sessions)
    shared = approx_tokens(w.sessions[0].system) + MESSAGE_OVERHEAD_TOKENS
    assert total_context_tokens(w) == per_session - 2 * shared


def test_invalid_params_are_refused() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        agent_params(arrival_rate=1.0)
    with pytest.raises(ValueError, match="exactly one"):
        agent_params(concurrency=None)
    with pytest.raises(ValueError, match="turns"):
        agent_params(turns=(6, 5))
    with pytest.raises(ValueError, match="seed"):
        agent_params(seed=-1)
    with pytest.raises(ValueError, match="unknown workload"):
        preset_params("nope")


def test_a_system_prompt_smaller_than_its_schemas_is_refused(corpus: Corpus) -> None:
    with pytest.raises(ValueError, match="tool schemas"):
        generate(agent_params(system_tokens=100), corpus=corpus)


def test_preset_overrides_switch_between_closed_and_open_loop() -> None:
    assert preset_params("agent", arrival_rate=0.5).concurrency is None
    assert preset_params("memory-pressure", concurrency=4).arrival_rate is None


# --- sizing and corpus ---------------------------------------------------------------------

def test_take_tokens_hits_the_target_exactly() -> None:
    lines = (f"line {i} " + "x" * (i % 17) for i in range(10_000))
    for target in (1, 7, 100, 1234):
        assert approx_tokens(take_tokens(lines, target)) == target
    with pytest.raises(ValueError, match="ran out"):
        take_tokens(["short"], 50)


def test_the_corpus_is_the_packages_data_and_the_standard_library_only() -> None:
    """Nothing the repository edits (its docs once) may change a seed's workload."""
    c = load_corpus(max_code_files=5)
    assert [f.path for f in c.prose] == ["data/tiny_corpus.txt"]
    assert all(f.path.startswith("lib/") for f in c.code)
    assert len(c.code) == 5 and c.words and c.identifiers


# --- traces --------------------------------------------------------------------------------

def test_trace_round_trip(corpus: Corpus, tmp_path: Path) -> None:
    for w in (generate(agent_params(), corpus=corpus),
              build_workload("chat", corpus=corpus, sessions=3, arrival_rate=1.0)):
        path = tmp_path / f"{w.kind}.jsonl"
        write_trace(w, path)
        assert load_trace(path) == w
        assert len(path.read_text().splitlines()) == len(w.sessions) + 1


def _session(session_id: str = "s1", **turn: object) -> dict[str, object]:
    first = {"user": "hi", "role": "user", "max_tokens": 8, "think_time_s": 0.0, **turn}
    return {"session_id": session_id, "system": "You help.", "turns": [
        first, {"user": "ls output", "role": "tool", "max_tokens": 4, "think_time_s": 1.5}]}


def _write(path: Path, *lines: object) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_trace_without_header_is_an_open_loop_trace(tmp_path: Path) -> None:
    w = load_trace(_write(tmp_path / "users.jsonl", _session("a"), "", _session("b")))
    assert isinstance(w, Workload)
    assert (w.name, w.kind, w.seed, w.concurrency) == ("users", "trace", 0, None)
    assert [s.session_id for s in w.sessions] == ["a", "b"]
    assert w.sessions[1].turns[1].think_time_s == 1.5


@pytest.mark.parametrize(("lines", "message"), [
    ([_session(), "{not json"], r":2: not JSON"),
    ([_session(), "[1, 2]"], r":2: expected a JSON object"),
    ([_session(max_tokens=0)], r":1: turns\.0\.max_tokens: .*greater than or equal to 1"),
    ([_session(role="tool")], r":1: .*first turn must be a user message"),
    ([_session(think_time_s=2.0)], r":1: .*think_time_s must be 0"),
    ([_session(extra=1)], r":1: turns\.0\.extra: Extra inputs"),
    ([_session("bad id!")], r":1: session_id: "),
    ([_session("a"), _session("a")], r"session_id 'a' appears twice"),
    ([_session(), {"trace": "turnkv", "version": 1, "name": "x"}], r":2: a header must be"),
    ([{"trace": "turnkv", "version": 2, "name": "x"}, _session()], r":1: version: "),
    ([{"trace": "turnkv", "version": 1, "name": "x"}], r"no sessions"),
])
def test_trace_errors_name_the_line(tmp_path: Path, lines: list[object], message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(_write(tmp_path / "bad.jsonl", *lines))


def test_tool_schemas_in_the_system_prompt_match_tools(corpus: Corpus) -> None:
    s = generate(agent_params(sessions=1, tool_count=8), corpus=corpus).sessions[0]
    assert s.tools is not None and len(s.tools) == 8
    for tool in s.tools:
        assert json.dumps(tool["function"], separators=(",", ":")) in s.system


def test_agent_longtool_is_long_tool_outputs_beside_sessions_that_decode(
        corpus: Corpus) -> None:
    """Agents whose tool outputs are thousands of tokens, each beside a session of short
    questions and long answers, every session at once on the same engines."""
    workload = build_workload("agent-longtool", corpus=corpus)
    assert {"conversation", "agent", "agent-pressure", "agent-longtool"} <= set(PRESETS)
    agents = [s for s in workload.sessions if s.tools is not None]
    beside = [s for s in workload.sessions if s.tools is None]
    assert len(agents) == len(beside) == 2 and workload.concurrency == 4
    for s in agents:
        tools = [approx_tokens(t.user) for t in s.turns if t.role == "tool"]
        assert len(tools) >= 3 and all(1000 <= n <= 3000 for n in tools), tools
        assert sum(tools) >= 4000 and session_context(s) <= 8192
        assert all(t.max_tokens <= 48 for t in s.turns)
    for s in beside:
        assert all(t.role == "user" and approx_tokens(t.user) <= 60 for t in s.turns)
        assert all(t.max_tokens >= 192 for t in s.turns) and len(s.turns) >= 6
    # --sessions scales both kinds, all of them still at once; --concurrency is as given.
    more = build_workload("agent-longtool", corpus=corpus, sessions=3)
    assert (len(more.sessions), more.concurrency) == (6, 6)
    assert build_workload("agent-longtool", corpus=corpus, concurrency=2).concurrency == 2
