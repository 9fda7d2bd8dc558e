"""One run's summary: the aggregates of one mode's records and engine counters.

Everything here summarizes a single run of a mode; `aggregate` combines the runs of a mode
repeated with `--repeat`. A total over records that never carried a value stays `None`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from turnkv_server.bench.results import (
    ModeRun,
    ModeStatus,
    ModeSummary,
    TokenTotals,
    TurnRecord,
    percentiles,
    total,
)

# A gap between two output chunks longer than this many times the run's median gap counts as
# a decode step that waited behind prompt work. On a CPU a prompt token costs a sizeable share
# of a decode step, so a step that also computed a delta of several dozen tokens, or waited
# for a long prefill, takes about twice as long or more; a factor closer to 1 would count the
# ordinary jitter of a 2-core machine as stalls.
STALL_FACTOR = 2.0

# The engine counters of prompt tokens by source, by the `TokenTotals` field they fill.
_SOURCES = {"cached": "prompt_tokens_local_cache_hit",
            "received": "prompt_tokens_external_kv_transfer",
            "computed": "prompt_tokens_local_compute"}


def itl_stalls(gaps: Sequence[float]) -> tuple[float | None, float | None]:
    """(decode step ms, stalled share) of a run's inter-chunk gaps.

    The decode step is the median gap: the typical step as the client sees it. A gap longer
    than `STALL_FACTOR` steps is one in which the engine did more than decode the sequences
    it was running (a prefill chunk or a delta computed in the same step, or a step that
    waited for one), or in which something else held the cores. The share is taken over
    every gap, so it reads as "this fraction of the decode steps a client saw were stalled".
    It under-reports when more than half of the gaps are stalled (the median is then a
    stalled step); the ITL percentiles beside it show that case.
    """
    if not gaps:
        return None, None
    step = float(np.median(np.asarray(gaps, dtype=float)))
    stalled = sum(1 for gap in gaps if gap > STALL_FACTOR * step)
    return step, stalled / len(gaps)


def engine_tokens(counters: Mapping[str, Mapping[str, float]]) -> dict[str, TokenTotals]:
    """Each engine's own account of its prompt tokens (`vllm:prompt_tokens_by_source`): what
    it found in its prefix cache, received over KV transfer and computed, over the run.

    Engines that do not export the counters are left out rather than reported as 0.
    """
    out: dict[str, TokenTotals] = {}
    for name, c in counters.items():
        if _SOURCES["computed"] not in c:
            continue
        parts = {field: round(c.get(key, 0.0)) for field, key in _SOURCES.items()}
        out[name] = TokenTotals(total=round(c.get("prompt_tokens", sum(parts.values()))),
                                reused=parts["cached"] + parts["received"], **parts)
    return out


def sum_tokens(parts: Sequence[TokenTotals]) -> TokenTotals | None:
    """Field by field sums (a field no part reported stays `None`); None for no parts."""
    if not parts:
        return None
    return TokenTotals(**{field: total(getattr(p, field) for p in parts)
                          for field in ("total", "cached", "received", "computed", "reused")})


def _per_second(amount: float | None, wall_s: float | None, status: ModeStatus) -> float | None:
    if amount is None or status.state != "ok" or not wall_s:
        return None
    return amount / wall_s


def _recompute_fraction(records: Sequence[TurnRecord]) -> float | None:
    both = [
        ((r.prefill_computed or 0) + (r.decode_computed or 0), r.prompt_tokens)
        for r in records
        if (r.prefill_computed is not None or r.decode_computed is not None) and r.prompt_tokens
    ]
    if not both:
        return None
    return sum(c for c, _ in both) / sum(p for _, p in both)


def _prefill_sources(engines: Mapping[str, TokenTotals]) -> TokenTotals | None:
    prefill = [t for name, t in engines.items() if name.startswith(("prefill", "single"))]
    found = sum_tokens(prefill)
    # The prefill engines' own split never had a `reused` field: cached + received is derived.
    return found.model_copy(update={"reused": None}) if found else None


def _nixl_bytes(run: ModeRun) -> int | None:
    # Engine-wide totals: upstream connectors do not attribute transfers to turns.
    moved = [c[key] for c in run.engine_counters.values()
             for key in ("nixl_bytes_transferred", "turnkv_bytes_received") if key in c]
    return round(sum(moved)) if moved else None


def summarize(run: ModeRun) -> ModeSummary:
    """Aggregate one run's records; turns with an error count only in `errors`."""
    ok = [r for r in run.records if r.error is None]
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        if r.ttft_ms is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft_ms)

    def values(get: Callable[[TurnRecord], float | None]) -> list[float]:
        return [v for v in (get(r) for r in ok) if v is not None]

    gaps = [gap for r in ok for gap in r.itl_ms]
    step, stall_share = itl_stalls(gaps)
    engines = engine_tokens(run.engine_counters)
    return ModeSummary(
        mode=run.mode,
        repeat=run.repeat,
        status=run.status,
        wall_s=run.wall_s,
        turns_ok=len(ok),
        errors=len(run.records) - len(ok),
        fallbacks=sum(r.fallback is not None for r in ok),
        prefix_breaks=sum(r.prefix_break_at is not None for r in ok),
        ttft_ms=percentiles(values(lambda r: r.ttft_ms)),
        ttft_ms_by_turn={t: percentiles(v) for t, v in sorted(by_turn.items())},
        ttft_ms_later=percentiles([v for t, vs in by_turn.items() if t > 0 for v in vs]),
        prefill_phase_ms=percentiles(values(lambda r: r.prefill_phase_ms)),
        itl_ms=percentiles(gaps),
        decode_step_ms=step,
        itl_stall_share=stall_share,
        e2e_ms=percentiles(values(lambda r: r.e2e_ms)),
        output_tokens_per_s=_per_second(
            total(r.completion_tokens for r in ok), run.wall_s, run.status
        ),
        turns_per_s=_per_second(len(ok), run.wall_s, run.status),
        prompt_tokens=TokenTotals(
            total=total(r.prompt_tokens for r in ok),
            cached=total(r.prefill_cached for r in ok),
            received=total(r.prefill_received for r in ok),
            computed=total(r.prefill_computed for r in ok),
            reused=total(r.prefill_reused for r in ok),
        ),
        prefill_engine_tokens=_prefill_sources(engines),
        engine_tokens=engines,
        all_engines_tokens=sum_tokens(list(engines.values())),
        kv_to_decode_bytes=total(r.kv_to_decode_bytes for r in ok),
        kv_to_prefill_bytes=total(r.kv_to_prefill_bytes for r in ok),
        kv_moved_bytes=_nixl_bytes(run),
        recompute_fraction=_recompute_fraction(ok),
        cpu_s=dict(run.cpu_s),
    )
