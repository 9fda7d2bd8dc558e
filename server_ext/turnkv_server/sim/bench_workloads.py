"""Sessions from `turnkv bench`: its presets (`bench.presets`, generated as the bench generates
them), or the turns of a bench run replayed as they were measured.

A preset's sizes are counted with `count_tokens` (the bench's estimate by default, not a
model's tokenizer). A replay takes each turn's prompt and output tokens as the engines counted
them, the wait before each turn as the client slept it (from the previous turn's end to its
start) and each session's start, so that the simulated run is the measured one, turn for turn.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from turnkv_server.bench.presets import build_workload, preset_params
from turnkv_server.bench.sizing import MESSAGE_OVERHEAD_TOKENS, TokenCounter, approx_tokens
from turnkv_server.bench.workloads import Workload
from turnkv_server.sim.sessions import SimSession, SimTurn


def from_workload(workload: Workload,
                  count_tokens: TokenCounter = approx_tokens) -> list[SimSession]:
    """A bench workload's sessions, in tokens."""
    out = []
    for spec in workload.sessions:
        system = count_tokens(spec.system) + MESSAGE_OVERHEAD_TOKENS
        prefix = hashlib.sha1(spec.system.encode()).hexdigest()[:12]
        turns = []
        for index, turn in enumerate(spec.turns):
            tokens = count_tokens(turn.user) + 2 * MESSAGE_OVERHEAD_TOKENS
            turns.append(SimTurn(tokens + (system if index == 0 else 0), turn.max_tokens,
                                 turn.think_time_s))
        out.append(SimSession(spec.session_id, tuple(turns), spec.start_s, prefix, system))
    return out


def preset_prefix(name: str) -> tuple[str | None, int]:
    """(an ID, tokens) of preset `name`'s system prompt; (None, 0) for no preset of that
    name."""
    try:
        params = preset_params(name)
    except ValueError:
        return None, 0
    return f"{name}-system", params.system_tokens + MESSAGE_OVERHEAD_TOKENS


def preset_sessions(name: str, seed: int = 0, sessions: int | None = None,
                    kv_cache_tokens: int | None = None) -> tuple[list[SimSession], int | None]:
    """Preset `name`'s sessions and its concurrency (None: open loop, by start times)."""
    overrides: dict[str, Any] = {"sessions": sessions} if sessions else {}
    workload = build_workload(name, seed, kv_cache_tokens=kv_cache_tokens, **overrides)
    return from_workload(workload), workload.concurrency


def replay_records(records: Iterable[Mapping[str, Any]], prefix: str | None = None,
                   prefix_tokens: int = 0, homes: Mapping[str, int] | None = None
                   ) -> list[SimSession]:
    """The sessions of one bench run's turn records (`runs[i].records` of its results.json),
    all starting with the shared prefix `prefix` of `prefix_tokens` (the preset's system
    prompt: the records do not say), each on its engine in `homes` (`bench_homes`) where
    known; turns that failed end their session there."""
    by_session: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        by_session[record["session_id"]].append(record)
    starts = [r["started_at"] for rs in by_session.values() for r in rs]
    origin = min(starts) if starts else 0.0
    sessions = []
    for sid, turns in by_session.items():
        turns.sort(key=lambda r: r["turn"])
        made: list[SimTurn] = []
        context = 0
        previous_end = None
        for record in turns:
            if record.get("error") is not None or not record.get("prompt_tokens"):
                break
            out = max(1, int(record.get("completion_tokens") or 1))
            tokens_in = int(record["prompt_tokens"]) - context
            if tokens_in < 1:
                break  # the prompt did not grow (a retry): not a turn of this model
            gap = 0.0 if previous_end is None else max(0.0, record["started_at"] - previous_end)
            made.append(SimTurn(tokens_in, out, round(gap, 3)))
            context = int(record["prompt_tokens"]) + out
            previous_end = record["ended_at"]
        if made:
            sessions.append(SimSession(sid, tuple(made),
                                       round(turns[0]["started_at"] - origin, 3), prefix,
                                       min(prefix_tokens, made[0].tokens_in),
                                       home=(homes or {}).get(sid)))
    sessions.sort(key=lambda s: (s.start_s, s.session_id))
    return sessions


# Above this many sessions `bench_homes` does not search (2^n subsets).
_MAX_HOMED_SESSIONS = 16


def bench_homes(run: Mapping[str, Any]) -> dict[str, int]:
    """Each session's engine (index, in the order of the run's engine names) in a bench run of
    two aggregated engines: the records do not name it, but each engine's counters count the
    prompt tokens it was sent, and the one set of sessions whose prompts sum to the second
    engine's count was served there. Empty where the counters name no two engines, or no
    single set matches (a session moved, or two sets tie)."""
    counters = run.get("engine_counters") or {}
    names = sorted(counters)
    if len(names) != 2:
        return {}
    sent: dict[str, int] = defaultdict(int)
    for record in run["records"]:
        sent[record["session_id"]] += int(record.get("prompt_tokens") or 0)
    sessions = sorted(sent)
    target = int(counters[names[1]].get("prompt_tokens") or 0)
    if len(sessions) > _MAX_HOMED_SESSIONS:
        return {}
    found = [subset for k in range(len(sessions) + 1)
             for subset in itertools.combinations(sessions, k)
             if sum(sent[s] for s in subset) == target]
    if len(found) != 1:
        return {}
    return {s: int(s in found[0]) for s in sessions}
