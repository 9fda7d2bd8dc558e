"""Named workloads: `agent`, `chat`, `conversation`, `smoke`, `memory-pressure`,
`agent-pressure` and `agent-longtool`.

The shapes follow real agents and chats; the sizes are what a 2-core CPU machine runs in
minutes. SmolLM2 in float32 prefills about 150 tokens a second there at short contexts and
about 75 at 7,000 tokens (measured; docs/benchmarks.md), so `agent` keeps sessions under
4,096 tokens and `--sessions` scales it up on a real deployment. Sizes are counted with the
served model's tokenizer (see `sizing`).
"""

from __future__ import annotations

from typing import Any

from turnkv_server.bench.corpus import Corpus
from turnkv_server.bench.preset_names import (
    DEFAULT_PRESSURE,
    MAX_PRESSURE_SESSIONS,
    PRESETS,
    PRESSURE,
)
from turnkv_server.bench.sizing import TokenCounter, approx_tokens
from turnkv_server.bench.workloads import (
    SessionGenerator,
    Workload,
    WorkloadParams,
    generate,
    total_context_tokens,
)

_BASE: dict[str, dict[str, Any]] = {
    # Real agents: a shared system prompt with tool schemas (1,500 tokens),
    # heavy-tailed tool results of 100-2,000 tokens (lognormal, median 250), short outputs,
    # seconds of tool time between turns, 5-10 turns, every session at once.
    "agent": dict(kind="agent", sessions=4, concurrency=4, turns=(5, 10), system_tokens=1500,
                  tool_result_median=250.0, output_tokens=(16, 48), think_time_median_s=1.0,
                  think_time_sigma=0.8, think_time_max_s=10.0, max_context_tokens=4096),
    # People chatting: short questions and answers, seconds of reading and typing in between.
    "chat": dict(kind="chat", sessions=8, concurrency=4, turns=(3, 8), system_tokens=200,
                 user_tokens=(8, 60), output_tokens=(32, 96), think_time_median_s=4.0,
                 think_time_sigma=0.5, think_time_max_s=30.0, max_context_tokens=4096),
    # An earlier measurement of the upstream modes side by side (SmolLM2 in bf16, one core per
    # engine): one conversation of 8 turns, a 1,500-token first prompt, then about 470 new
    # tokens and the previous 64-token reply per turn.
    "conversation": dict(kind="agent", sessions=1, concurrency=1, turns=(8, 8),
                         system_tokens=1000, tool_count=3, tool_result_tokens=(400, 400),
                         tool_result_median=400.0, tool_result_sigma=0.0,
                         user_tokens=(480, 480), follow_up_prob=0.0, output_tokens=(64, 64),
                         think_time_median_s=0.5, think_time_sigma=0.0,
                         max_context_tokens=8192),
    # For the test suite on the tiny model: 2 sessions x 3 turns, under 1,000 tokens each. Its
    # small byte-level BPE needs about 360 tokens for the intro and three tool schemas.
    "smoke": dict(kind="agent", sessions=2, concurrency=2, turns=(3, 3), system_tokens=600,
                  tool_count=3, tool_result_tokens=(30, 80), tool_result_median=50.0,
                  user_tokens=(10, 30), follow_up_prob=0.0, output_tokens=(8, 16),
                  think_time_median_s=0.05, think_time_max_s=0.2, max_context_tokens=1536),
    # Sessions whose total context outgrows the KV cache, with tool time long enough for LRU
    # eviction to take each session's blocks before it returns (the shape of an earlier
    # memory-pressure measurement: a session's own head, 5 turns of about +250 tokens, 2 s of
    # tool time, starts about 0.5 s apart), sized to this machine.
    "memory-pressure": dict(kind="agent", sessions=MAX_PRESSURE_SESSIONS, arrival_rate=2.0,
                            turns=(5, 5), system_tokens=400, tool_count=3,
                            tool_result_tokens=(150, 250), tool_result_median=200.0,
                            tool_result_sigma=0.2, user_tokens=(200, 300), follow_up_prob=0.0,
                            output_tokens=(32, 32), think_time_median_s=2.0,
                            think_time_sigma=0.3, max_context_tokens=4096),
    # Agents under memory pressure, with room between the modes: each session's own history
    # grows past 3,000 tokens, a few hundred per turn (a short shared head, so that most of what
    # is held is the session's own), and the tool times are heavy-tailed (median 4 s, from
    # under a second to a minute) and sent ahead as `next_turn_in` hints. Sessions are added
    # until their context is 3x two engines' caches, starting about 2 s apart: all of them live
    # at once. Losing a session's KV then costs recomputing thousands of tokens where keeping
    # it costs a few hundred, which on this machine is several times the turn's time.
    "agent-pressure": dict(kind="agent", sessions=MAX_PRESSURE_SESSIONS, arrival_rate=0.5,
                           turns=(6, 8), system_tokens=300, tool_count=3,
                           tool_result_tokens=(150, 900), tool_result_median=320.0,
                           tool_result_sigma=0.4, user_tokens=(150, 300), follow_up_prob=0.15,
                           output_tokens=(24, 40), think_time_median_s=4.0,
                           think_time_sigma=1.3, think_time_max_s=60.0,
                           max_context_tokens=3000),
    # Agents whose tools return thousands of tokens (whole files read, long searches), each
    # beside a session that decodes long answers on the same engines (`_BESIDE`): an
    # aggregated engine's decodes then wait behind those prefills, which is where computing a
    # turn's new tokens on another engine should pay. Up to 8,192 tokens a session: SmolLM2's
    # context.
    "agent-longtool": dict(kind="agent", sessions=2, concurrency=4, turns=(4, 5),
                           system_tokens=1000, tool_count=3, tool_result_tokens=(1000, 3000),
                           tool_result_median=1800.0, tool_result_sigma=0.4,
                           user_tokens=(40, 120), follow_up_prob=0.0, output_tokens=(24, 48),
                           think_time_median_s=1.0, think_time_sigma=0.5, think_time_max_s=5.0,
                           max_context_tokens=8192),
}
# Presets that are two kinds of sessions: the preset's own, then as many of these beside them
# (session IDs `<preset>-beside-...`), all in one loop.
_BESIDE: dict[str, dict[str, Any]] = {
    # Short questions, long answers, little time between turns: sessions that are decoding
    # whenever an agent's tool output arrives.
    "agent-longtool": dict(kind="chat", turns=(6, 10), system_tokens=200, user_tokens=(20, 60),
                           output_tokens=(192, 256), think_time_median_s=0.3,
                           think_time_sigma=0.5, think_time_max_s=2.0, max_context_tokens=4096),
}


def preset_params(name: str, seed: int = 0, **overrides: Any) -> WorkloadParams:
    """The parameters of preset `name`, with any field replaced by `overrides`."""
    if name not in _BASE:
        raise ValueError(f"unknown workload {name!r}; the presets are {', '.join(PRESETS)}")
    fields = {**_BASE[name], **overrides}
    # A closed-loop override of an open-loop preset (or back) replaces the other setting.
    if "concurrency" in overrides and "arrival_rate" not in overrides:
        fields["arrival_rate"] = None
    if "arrival_rate" in overrides and "concurrency" not in overrides:
        fields["concurrency"] = None
    return WorkloadParams(name=name, seed=seed, **fields)


def build_workload(name: str, seed: int = 0, count_tokens: TokenCounter = approx_tokens,
                   corpus: Corpus | None = None,
                   kv_cache_tokens: int | None = None,
                   pressure: float | None = None, **overrides: Any) -> Workload:
    """Preset `name` generated; `kv_cache_tokens` and `pressure` (default: the preset's
    `Pressure`) apply to the presets in `PRESSURE`."""
    params = preset_params(name, seed, **overrides)
    if name in PRESSURE:
        sizing = PRESSURE[name]
        return memory_pressure(params, kv_cache_tokens or sizing.cache_tokens,
                               pressure or sizing.factor, count_tokens, corpus)
    if name in _BESIDE:
        workload = with_beside(params, _BESIDE[name], count_tokens, corpus)
        if "concurrency" in overrides or "arrival_rate" in overrides:
            return workload
        # Every session at once, the preset's own and those beside them.
        return workload.model_copy(update={"concurrency": len(workload.sessions)})
    return generate(params, count_tokens, corpus)


def with_beside(params: WorkloadParams, beside: dict[str, Any],
                count_tokens: TokenCounter = approx_tokens,
                corpus: Corpus | None = None) -> Workload:
    """`params`' sessions, then as many of `beside`'s (each from a random stream of its own,
    after theirs), in `params`' loop."""
    gen = SessionGenerator(params, count_tokens, corpus)
    own = [gen.session(i) for i in range(params.sessions)]
    other = WorkloadParams(**{**beside, "name": f"{params.name}-beside", "seed": params.seed,
                              "sessions": params.sessions, "concurrency": 1})
    other_gen = SessionGenerator(other, count_tokens, gen.corpus)
    others = [other_gen.session(params.sessions + i) for i in range(params.sessions)]
    return gen.workload(own + others)


def memory_pressure(params: WorkloadParams, kv_cache_tokens: int,
                    pressure: float = DEFAULT_PRESSURE,
                    count_tokens: TokenCounter = approx_tokens,
                    corpus: Corpus | None = None) -> Workload:
    """Sessions of `params` added until their total context exceeds `pressure` x the cache.

    `params.sessions` is the most it adds; running out of them first is an error, since the
    workload would then not be under pressure.
    """
    if kv_cache_tokens < 1 or pressure <= 1.0:
        raise ValueError("kv_cache_tokens must be positive and pressure above 1")
    gen = SessionGenerator(params, count_tokens, corpus)
    goal = pressure * kv_cache_tokens
    sessions = []
    for i in range(params.sessions):
        sessions.append(gen.session(i))
        workload = gen.workload(sessions)
        if total_context_tokens(workload, count_tokens) > goal:
            return workload
    raise ValueError(f"{params.sessions} sessions hold fewer than {goal:.0f} context tokens; "
                     f"allow more sessions or lower the pressure")
