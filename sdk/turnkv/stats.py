"""Turn and session statistics as the client sees them.

`TurnStats` is the router's per-turn record (`turnkv.protocol.RouterTurnStats`) plus what only
the client can measure. Against a server without turnkv it is built from the response's `usage`
alone (`served_by_turnkv=False`, `mode="plain"`). The models are data only: `turnkv.render`
draws them as tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast, get_args

from pydantic import BaseModel

from turnkv import protocol as p

PLAIN_MODE = "plain"


class TurnStats(p.RouterTurnStats):
    """One turn: where its prompt tokens came from, KV moved, router times, client times."""

    client_ttft_ms: float | None = None
    client_total_ms: float | None = None
    retries: int = 0
    served_by_turnkv: bool = True

    @classmethod
    def from_wire(cls, wire: p.RouterTurnStats | Mapping[str, Any], **client: Any) -> TurnStats:
        data = wire.model_dump() if isinstance(wire, p.RouterTurnStats) else dict(wire)
        return cls.model_validate({**data, **client, "served_by_turnkv": True})

    @classmethod
    def from_usage(cls, usage: Mapping[str, Any] | None, *, session_id: str | None, turn: int,
                   **client: Any) -> TurnStats:
        """Stats of a turn served without turnkv: `usage` is all there is."""
        usage = usage or {}
        total = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        tokens = p.PromptTokens(total=total)
        if cached is not None:
            tokens = p.PromptTokens(total=total, prefill_cached=int(cached),
                                    prefill_reused=int(cached),
                                    prefill_computed=total - int(cached))
        return cls(session_id=session_id, turn=turn, mode=PLAIN_MODE, prompt_tokens=tokens,
                   completion_tokens=int(usage.get("completion_tokens") or 0),
                   served_by_turnkv=False, **client)

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], *, turn: int,
                     usage: Mapping[str, Any] | None = None, **client: Any) -> TurnStats:
        """The router's early part alone (`X-TurnKV-*` response headers, lower-case keys),
        where its final stats never came: e.g. a stream that ended in an error event."""

        def number(name: str) -> int | None:
            value = headers.get(name.lower())
            return int(value) if value is not None and value.isdigit() else None

        usage = usage or {}
        computed, cached = number(p.HEADER_PREFILL_COMPUTED), number(p.HEADER_PREFILL_CACHED)
        total = int(usage.get("prompt_tokens") or 0) or (computed or 0) + (cached or 0)
        fallback = headers.get(p.HEADER_FALLBACK.lower())
        reason = cast("p.FallbackReason", fallback) if fallback in get_args(
            p.FallbackReason) else None
        return cls(
            session_id=headers.get(p.HEADER_SESSION.lower()),
            turn=number(p.HEADER_TURN) or turn, mode="unknown",
            prefill_node=headers.get(p.HEADER_PREFILL_NODE.lower()) or None,
            decode_node=headers.get(p.HEADER_DECODE_NODE.lower()) or None,
            prompt_tokens=p.PromptTokens(total=total, prefill_computed=computed,
                                         prefill_cached=cached),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            prefix_break_at=number(p.HEADER_PREFIX_BREAK_AT),
            fallback=reason,
            **client)

    def wire(self) -> p.RouterTurnStats:
        """The router's part alone, comparable with `GET /v1/turnkv/sessions/{id}`."""
        fields = set(p.RouterTurnStats.model_fields)
        return p.RouterTurnStats.model_validate(self.model_dump(include=fields))

    @property
    def reused_tokens(self) -> int | None:
        """Prompt tokens the prefill side (or, for a turn without one, the decode engine) did
        not compute; None where nobody measured it."""
        tokens = self.prompt_tokens
        if tokens.prefill_reused is not None:
            return tokens.prefill_reused
        if tokens.prefill_computed is not None:
            return tokens.total - tokens.prefill_computed
        if tokens.prefill_cached is not None or tokens.prefill_received is not None:
            return (tokens.prefill_cached or 0) + (tokens.prefill_received or 0)
        if tokens.decode_computed is not None:
            # No prefill side: turnkv served a short delta on the decode engine alone, or
            # affinity served the turn on the session's engine.
            return tokens.total - tokens.decode_computed
        return None

    @property
    def computed_tokens(self) -> int | None:
        reused = self.reused_tokens
        if self.prompt_tokens.prefill_computed is not None:
            return self.prompt_tokens.prefill_computed
        return None if reused is None else self.prompt_tokens.total - reused


def prefill_cost_ms(turn: TurnStats) -> float | None:
    """The time the engine took to compute this turn's computed prompt tokens: its own
    measurement (`times.engine_prefill_ms`) where it reported one, else the router's
    `times.prefill_ms` (which adds the HTTP round trip); None where neither was measured."""
    if turn.times.engine_prefill_ms is not None:
        return turn.times.engine_prefill_ms
    return turn.times.prefill_ms if turn.times.prefill_ms > 0 else None


def estimate_prefill_saved(measured: Sequence[tuple[int, float]], reused: int
                           ) -> tuple[float | None, float | None]:
    """(ms per token, seconds saved): what computing `reused` prompt tokens would have cost,
    estimated from a session's `measured` prefills, (tokens computed, ms) per turn.

    Every measured time includes a fixed cost per request and per engine step, which a turn
    that computed few tokens spreads over few of them: a session's average rate, weighed down
    by such turns, overestimates what reuse saved (once by more than the run's whole length;
    docs/sdk.md). The rate is the cost of one
    more token: the slope of a least-squares line through the turns' (tokens, ms), where the
    turns computed different numbers of tokens and the slope is positive, else the lowest
    per-token cost any turn measured; never above that lowest cost. So no turn's estimate
    exceeds a time the engine measured: for a turn that reused `r` tokens, `rate * r` is at
    most the time of any measured turn that computed `r` tokens or more (which cost at least
    as much as computing an `r`-token prefix would have). Past the largest measured turn it
    extrapolates linearly, and attention makes longer prompts cost a little more per token:
    an underestimate there. (None, None) without a measured prefill.
    """
    points = [(tokens, ms) for tokens, ms in measured if tokens > 0 and ms > 0]
    if not points:
        return None, None
    rate = min(ms / tokens for tokens, ms in points)
    mean_tokens = sum(tokens for tokens, _ in points) / len(points)
    mean_ms = sum(ms for _, ms in points) / len(points)
    spread = sum((tokens - mean_tokens) ** 2 for tokens, _ in points)
    if spread > 0:
        slope = sum((tokens - mean_tokens) * (ms - mean_ms) for tokens, ms in points) / spread
        if slope > 0:
            rate = min(rate, slope)
    return rate, rate * reused / 1000.0


class SessionStats(BaseModel):
    """Totals over a session's recorded turns (a retried turn is one turn).

    `estimated_prefill_s_saved` is an estimate, not a measurement: what computing the reused
    tokens would have cost at `prefill_ms_per_token`, the cost of one more prompt token as
    the engines measured it on this session's turns (see `estimate_prefill_saved`). None when
    no turn measured a prefill.
    """

    session_id: str | None = None
    turns: int = 0
    turns_served_by_turnkv: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_reused: int = 0
    prompt_tokens_computed: int = 0
    completion_tokens: int = 0
    # Reused / (reused + computed) over the turns where the split is known.
    hit_ratio: float | None = None
    prefill_tokens_saved: int = 0
    # The estimate's rate: the measured cost of one more prompt token (`estimate_prefill_saved`).
    prefill_ms_per_token: float | None = None
    estimated_prefill_s_saved: float | None = None
    fallbacks: int = 0
    prefix_breaks: int = 0
    retries: int = 0

    @classmethod
    def from_turns(cls, stats: Iterable[TurnStats], session_id: str | None = None
                   ) -> SessionStats:
        out = cls(session_id=session_id)
        measured: list[tuple[int, float]] = []
        for turn in stats:
            out.turns += 1
            out.turns_served_by_turnkv += int(turn.served_by_turnkv)
            out.prompt_tokens_total += turn.prompt_tokens.total
            out.completion_tokens += turn.completion_tokens
            reused, computed = turn.reused_tokens, turn.computed_tokens
            if reused is not None and computed is not None:
                out.prompt_tokens_reused += reused
                out.prompt_tokens_computed += computed
            out.fallbacks += int(turn.fallback is not None)
            out.prefix_breaks += int(turn.prefix_break_at is not None)
            out.retries += turn.retries
            cost = prefill_cost_ms(turn)
            if turn.served_by_turnkv and computed and cost:
                measured.append((computed, cost))
        known = out.prompt_tokens_reused + out.prompt_tokens_computed
        out.hit_ratio = out.prompt_tokens_reused / known if known else None
        out.prefill_tokens_saved = out.prompt_tokens_reused
        out.prefill_ms_per_token, out.estimated_prefill_s_saved = estimate_prefill_saved(
            measured, out.prefill_tokens_saved)
        return out
