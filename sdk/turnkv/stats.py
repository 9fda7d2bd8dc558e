"""Turn and session statistics as the client sees them.

`TurnStats` is the router's per-turn record (`turnkv.protocol.TurnStats`) plus what only the
client can measure. Against a server without turnkv it is built from the response's `usage`
alone (`served_by_turnkv=False`, `mode="plain"`). The models are data only: `turnkv.render`
draws them as tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast, get_args

from pydantic import BaseModel

from turnkv import protocol as p

PLAIN_MODE = "plain"


class TurnStats(p.TurnStats):
    """One turn: where its prompt tokens came from, KV moved, router times, client times."""

    client_ttft_ms: float | None = None
    client_total_ms: float | None = None
    retries: int = 0
    served_by_turnkv: bool = True

    @classmethod
    def from_wire(cls, wire: p.TurnStats | Mapping[str, Any], **client: Any) -> TurnStats:
        data = wire.model_dump() if isinstance(wire, p.TurnStats) else dict(wire)
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

    def wire(self) -> p.TurnStats:
        """The router's part alone, comparable with `GET /v1/turnkv/sessions/{id}`."""
        return p.TurnStats.model_validate(self.model_dump(include=set(p.TurnStats.model_fields)))

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
            # turnkv served a short delta on the decode engine alone: no prefill side.
            return tokens.total - tokens.decode_computed
        return None

    @property
    def computed_tokens(self) -> int | None:
        reused = self.reused_tokens
        if self.prompt_tokens.prefill_computed is not None:
            return self.prompt_tokens.prefill_computed
        return None if reused is None else self.prompt_tokens.total - reused


class SessionStats(BaseModel):
    """Totals over a session's recorded turns (a retried turn is one turn).

    `estimated_prefill_s_saved` is an estimate, not a measurement: the session's measured
    prefill time per computed token (router `times.prefill_ms` summed over the turns that
    computed tokens, divided by the tokens they computed) times the tokens it reused. The
    prefill time includes the prefill request's fixed overhead, and attention makes long
    prompts cost more per token, so it is a linear estimate from this session's own turns.
    None when no turn measured a prefill.
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
    prefill_ms_per_token: float | None = None
    estimated_prefill_s_saved: float | None = None
    fallbacks: int = 0
    prefix_breaks: int = 0
    retries: int = 0

    @classmethod
    def from_turns(cls, stats: Iterable[TurnStats], session_id: str | None = None
                   ) -> SessionStats:
        out = cls(session_id=session_id)
        prefill_ms = 0.0
        prefill_tokens = 0
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
            if turn.served_by_turnkv and computed and turn.times.prefill_ms > 0:
                prefill_ms += turn.times.prefill_ms
                prefill_tokens += computed
        known = out.prompt_tokens_reused + out.prompt_tokens_computed
        out.hit_ratio = out.prompt_tokens_reused / known if known else None
        out.prefill_tokens_saved = out.prompt_tokens_reused
        if prefill_tokens:
            out.prefill_ms_per_token = prefill_ms / prefill_tokens
            out.estimated_prefill_s_saved = (
                out.prefill_ms_per_token * out.prefill_tokens_saved / 1000.0)
        return out
