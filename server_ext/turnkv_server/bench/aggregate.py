"""A benchmark's runs combined: per mode the median of its runs' figures and their spread, and
ratios against the baseline mode with the spread of the per-repeat ratios.

With `--repeat N` every mode ran N times, interleaved (A B C A B C), so repeat r of two modes
ran close together in time: the per-repeat ratio pairs them, and its spread over the repeats
shows how much the machine's drift and noise move a ratio. A mode's figure is the median of
its runs' figures (each run's own median, p90...), with their min and max.

A run that stalled or failed does not count: its numbers cover only the turns before it
stopped. A mode none of whose runs finished still shows its runs' partial latencies (marked by
its status), but gets no ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from turnkv_server.bench.results import (
    BenchResult,
    ModeAggregate,
    ModeStatus,
    ModeSummary,
    Spread,
    TokenTotals,
)
from turnkv_server.bench.summary import summarize

Getter = Callable[[ModeSummary], float | None]

# The headline figures every table shows per mode, by name.
FIGURES: dict[str, Getter] = {
    "ttft_p50": lambda s: s.ttft_ms.p50,
    "ttft_p90": lambda s: s.ttft_ms.p90,
    "ttft_p99": lambda s: s.ttft_ms.p99,
    "ttft_later_p50": lambda s: s.ttft_ms_later.p50,
    "ttft_later_p90": lambda s: s.ttft_ms_later.p90,
    "prefill_phase_p50": lambda s: s.prefill_phase_ms.p50,
    "itl_p50": lambda s: s.itl_ms.p50,
    "itl_p99": lambda s: s.itl_ms.p99,
    "itl_stall_share": lambda s: s.itl_stall_share,
    "decode_step_ms": lambda s: s.decode_step_ms,
    "e2e_p50": lambda s: s.e2e_ms.p50,
    "output_tokens_per_s": lambda s: s.output_tokens_per_s,
    "turns_per_s": lambda s: s.turns_per_s,
    "recompute_fraction": lambda s: s.recompute_fraction,
    "engines_computed": lambda s: (s.all_engines_tokens.computed
                                   if s.all_engines_tokens else None),
    # The engines' own NIXL count where they export one, else the turns' sum.
    "kv_moved_bytes": lambda s: (s.kv_moved_bytes if s.kv_moved_bytes is not None
                                 else s.kv_to_decode_bytes),
    "wall_s": lambda s: s.wall_s,
}

# The figures that get a ratio against the baseline mode. Lower is better for latencies,
# higher for throughputs; a ratio is plain this/baseline either way.
RATIO_METRICS: tuple[str, ...] = (
    "ttft_p50", "ttft_p90", "ttft_p99", "ttft_later_p50", "ttft_later_p90", "itl_p50",
    "itl_p99", "e2e_p50", "output_tokens_per_s", "recompute_fraction")


def spread(values: Sequence[float | None]) -> Spread:
    """Median (numpy's: the mean of the middle two for an even count), min and max of the
    values that were reported; all `None` when none was."""
    known = [v for v in values if v is not None]
    if not known:
        return Spread()
    return Spread(n=len(known), median=float(np.median(np.asarray(known, dtype=float))),
                  min=min(known), max=max(known))


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or `None` when either is missing or the base is 0."""
    if value is None or not base:
        return None
    return value / base


def _finished(runs: Sequence[ModeSummary]) -> list[ModeSummary]:
    return [s for s in runs if s.status.state == "ok"]


def _counted(runs: Sequence[ModeSummary]) -> list[ModeSummary]:
    # The finished runs; a mode with none still shows its partial numbers.
    return _finished(runs) or list(runs)


def _status(runs: Sequence[ModeSummary]) -> ModeStatus:
    """ok when every run was; ok with a detail naming the others when some were; else the
    first run's state, with each run's reason."""
    bad = [s for s in runs if s.status.state != "ok"]
    if not bad:
        return ModeStatus(state="ok")
    if len(runs) == 1:
        return bad[0].status
    detail = "; ".join(f"run {s.repeat + 1} {s.status.state}"
                       + (f": {s.status.detail}" if s.status.detail else "") for s in bad)
    return ModeStatus(state="ok" if len(bad) < len(runs) else bad[0].status.state,
                      detail=detail)


def _median_tokens(parts: Sequence[TokenTotals]) -> TokenTotals:
    fields = ("total", "cached", "received", "computed", "reused")
    medians = {f: spread([getattr(p, f) for p in parts]).median for f in fields}
    return TokenTotals(**{f: None if v is None else round(v) for f, v in medians.items()})


def aggregate_mode(runs: Sequence[ModeSummary]) -> ModeAggregate:
    """One mode's runs (its summaries) combined: every figure's median and range."""
    counted = _counted(runs)
    turns = sorted({t for s in counted for t in s.ttft_ms_by_turn})

    def by_turn(get: Callable[[ModeSummary, int], float | None]) -> dict[int, Spread]:
        return {t: spread([get(s, t) for s in counted]) for t in turns}

    # In the order the runs recorded them (the launcher's: prefill engines first).
    engines = list(dict.fromkeys(name for s in counted for name in s.engine_tokens))
    all_engines = [s.all_engines_tokens for s in counted if s.all_engines_tokens]
    return ModeAggregate(
        mode=runs[0].mode,
        status=_status(runs),
        runs=len(runs),
        runs_ok=len(_finished(runs)),
        figures={name: spread([get(s) for s in counted]) for name, get in FIGURES.items()},
        ttft_p50_by_turn=by_turn(lambda s, t: p.p50 if (p := s.ttft_ms_by_turn.get(t)) else None),
        ttft_p90_by_turn=by_turn(lambda s, t: p.p90 if (p := s.ttft_ms_by_turn.get(t)) else None),
        engine_tokens={name: _median_tokens([s.engine_tokens[name] for s in counted
                                             if name in s.engine_tokens]) for name in engines},
        all_engines_tokens=_median_tokens(all_engines) if all_engines else None,
    )


def by_mode(summaries: Sequence[ModeSummary]) -> dict[str, list[ModeSummary]]:
    """Each mode's runs in repeat order, modes in the order they first ran."""
    out: dict[str, list[ModeSummary]] = {}
    for s in summaries:
        out.setdefault(s.mode, []).append(s)
    return out


def paired_ratio(runs: Sequence[ModeSummary], base: Sequence[ModeSummary],
                 get: Getter) -> tuple[float | None, Spread]:
    """(the ratio of the two modes' medians, the spread of the per-repeat ratios).

    Only finished runs count: repeat r of one mode is paired with repeat r of the other when
    both finished. `None` and an empty spread when either mode has no finished run.
    """
    mine, theirs = _finished(runs), _finished(base)
    if not mine or not theirs:
        return None, Spread()
    median = ratio(spread([get(s) for s in mine]).median, spread([get(s) for s in theirs]).median)
    other = {s.repeat: s for s in theirs}
    pairs = [ratio(get(s), get(other[s.repeat])) for s in mine if s.repeat in other]
    return median, spread(pairs)


def ratios(summaries: Sequence[ModeSummary], baseline: str
           ) -> tuple[dict[str, dict[str, float | None]], dict[str, dict[str, Spread]]]:
    """Each mode's `RATIO_METRICS` against the baseline mode's: (ratios of the medians, the
    spread of the per-repeat ratios). A mode with no finished run (or such a baseline) gets
    `None`: partial numbers describe only the turns before it stopped."""
    modes = by_mode(summaries)
    if baseline not in modes:
        raise ValueError(f"baseline mode {baseline!r} is not among the results")
    values: dict[str, dict[str, float | None]] = {}
    spreads: dict[str, dict[str, Spread]] = {}
    for mode, runs in modes.items():
        values[mode], spreads[mode] = {}, {}
        for name in RATIO_METRICS:
            values[mode][name], spreads[mode][name] = paired_ratio(runs, modes[baseline],
                                                                   FIGURES[name])
    return values, spreads


def later_ttft_matrix(summaries: Sequence[ModeSummary]
                      ) -> tuple[dict[str, dict[str, float | None]], dict[str, dict[str, Spread]]]:
    """Every mode against every other: the ratio of their median TTFTs after the first turn,
    and the spread of the per-repeat ratios."""
    modes = by_mode(summaries)
    get = FIGURES["ttft_later_p50"]
    values: dict[str, dict[str, float | None]] = {}
    spreads: dict[str, dict[str, Spread]] = {}
    for a, runs in modes.items():
        values[a], spreads[a] = {}, {}
        for b, others in modes.items():
            values[a][b], spreads[a][b] = paired_ratio(runs, others, get)
    return values, spreads


def finalize(result: BenchResult, baseline: str | None) -> BenchResult:
    """Fill in every run's summary, each mode's aggregate, the mode-by-mode matrix and, given a
    baseline mode, the ratios: everything derived, from the recorded runs alone."""
    summaries = [summarize(run) for run in result.runs]
    values, spreads = ratios(summaries, baseline) if baseline else ({}, {})
    matrix, matrix_spread = later_ttft_matrix(summaries)
    return result.model_copy(
        update={
            "baseline": baseline,
            "repeats": max([result.repeats, *(run.repeat + 1 for run in result.runs)]),
            "summaries": summaries,
            "aggregates": [aggregate_mode(runs) for runs in by_mode(summaries).values()],
            "ratios": values,
            "ratio_spread": spreads,
            "later_ttft_p50_matrix": matrix,
            "later_ttft_p50_matrix_spread": matrix_spread,
        }
    )
