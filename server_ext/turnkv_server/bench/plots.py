"""The benchmark's PNG plots, drawn from a finalized `BenchResult`.

Each mode is drawn from its aggregate: with `--repeat N` a point is the median of the runs'
figures and its error bar their range (min to max); with one run there is no bar. A stalled or
failed mode is drawn dashed and labelled with its state.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

# Figure objects without pyplot: no global state and no GUI backend; savefig renders with Agg.
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from turnkv_server.bench.results import BenchResult, ModeAggregate, Spread, TokenTotals
from turnkv_server.mode_names import itl_variant_target

# Stacked in this order, bottom up: reuse first, so the bar's top is what was computed.
# "reused" stands for cached + received where a mode reports only their sum (bidirectional's
# turn stats).
SOURCES = ("cached", "received", "reused", "computed")


def legend(agg: ModeAggregate) -> str:
    """The mode, with its state when not ok."""
    return agg.mode if agg.status.state == "ok" else f"{agg.mode} ({agg.status.state})"


def _style(agg: ModeAggregate) -> str:
    return "-" if agg.status.state == "ok" else "--"


def _errors(spreads: list[Spread]) -> np.ndarray | None:
    """Asymmetric error bars (below, above the median) for spreads over several runs."""
    if not any(s.n > 1 for s in spreads):
        return None
    return np.array([[(s.median or 0) - (s.min or 0) for s in spreads],
                     [(s.max or 0) - (s.median or 0) for s in spreads]])


def _runs_note(result: BenchResult) -> str:
    return f"; median of {result.repeats} runs, bars min-max" if result.repeats > 1 else ""


def plot_ttft_by_turn(result: BenchResult, path: Path) -> Path:
    """TTFT p50 by turn index per mode, with a band up to p90."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for agg in result.aggregates:
        turns = [t for t, s in sorted(agg.ttft_p50_by_turn.items())
                 if s.median is not None and agg.ttft_p90_by_turn[t].median is not None]
        if not turns:
            continue
        p50 = [agg.ttft_p50_by_turn[t] for t in turns]
        # Both medians are known for every turn kept above.
        p90 = [agg.ttft_p90_by_turn[t].median or 0.0 for t in turns]
        # 1-based on the axis, as in the tables of docs/benchmarks.md.
        x = [t + 1 for t in turns]
        y = [s.median or 0.0 for s in p50]
        (line,) = ax.plot(x, y, _style(agg), marker="o", label=legend(agg))
        errors = _errors(p50)
        if errors is not None:
            ax.errorbar(x, y, yerr=errors, fmt="none", capsize=3, color=line.get_color())
        ax.fill_between(x, y, p90, alpha=0.15, color=line.get_color())
    ax.set_xlabel("turn")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("TTFT at the client (ms); line p50, band to p90")
    ax.set_title(f"TTFT by turn: {result.workload.name}, {result.model}{_runs_note(result)}",
                 fontsize=10)
    ax.grid(alpha=0.3)
    _legend_if_any(ax)
    return _save(fig, path)


def plot_ttft_cdf(result: BenchResult, path: Path) -> Path:
    """Empirical CDF of TTFT per mode over the turns that finished without error, the turns of
    all of a mode's finished runs pooled (of all its runs when none finished)."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for agg in result.aggregates:
        runs = [r for r in result.runs if r.mode == agg.mode]
        finished = [r for r in runs if r.status.state == "ok"] or runs
        ttft = np.sort([r.ttft_ms for run in finished for r in run.records
                        if r.error is None and r.ttft_ms is not None])
        if ttft.size == 0:
            continue
        # From 0 at the fastest turn, so that a mode with a single turn still draws its step.
        x = np.concatenate([ttft[:1], ttft])
        y = np.arange(ttft.size + 1) / ttft.size
        ax.step(x, y, _style(agg), where="post", label=legend(agg))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT at the client (ms, log scale)")
    ax.set_ylabel("fraction of turns" + (", all runs" if result.repeats > 1 else ""))
    ax.set_ylim(0, 1.02)
    ax.set_title(f"TTFT CDF: {result.workload.name}, {result.model}")
    ax.grid(alpha=0.3, which="both")
    _legend_if_any(ax)
    return _save(fig, path)


def source_parts(tokens: TokenTotals) -> dict[str, int]:
    """The reported parts of an account of prompt tokens, nothing for unreported ones."""
    parts = {k: v for k in ("cached", "received", "computed")
             if (v := getattr(tokens, k)) is not None}
    if "cached" not in parts and "received" not in parts and tokens.reused is not None:
        parts["reused"] = tokens.reused
    return parts


def _token_bars(result: BenchResult) -> list[tuple[str, dict[str, int]]]:
    """(label, parts) per bar: each engine of each mode, then the mode's engines together.

    A mode without engine counters (results from before they were recorded) falls back on its
    first run's turn stats, which cover the prefill side only."""
    bars: list[tuple[str, dict[str, int]]] = []
    for agg in result.aggregates:
        name = legend(agg)
        if agg.engine_tokens:
            bars += [(f"{name}\n{engine}", source_parts(t))
                     for engine, t in agg.engine_tokens.items()]
            if len(agg.engine_tokens) > 1 and agg.all_engines_tokens is not None:
                bars.append((f"{name}\nall engines", source_parts(agg.all_engines_tokens)))
            continue
        turns = [s.prompt_tokens for s in result.summaries if s.mode == agg.mode]
        bars.append((f"{name}\nturn stats", source_parts(turns[0]) if turns else {}))
    return bars


def plot_prompt_sources(result: BenchResult, path: Path) -> Path:
    """Stacked bars: the prompt tokens each engine found cached, received and computed, per
    mode, and the engines together (a prompt both engines handled counts on each)."""
    bars = _token_bars(result)
    fig = Figure(figsize=(max(8.0, 0.9 * len(bars)), 5))
    ax = fig.subplots()
    x = np.arange(len(bars))
    bottom = np.zeros(len(bars))
    for source in SOURCES:
        heights = np.array([parts.get(source, 0) for _, parts in bars], dtype=float)
        if heights.any():
            label = source + (" (split not reported)" if source == "reused" else "")
            ax.bar(x, heights, bottom=bottom, label=label)
            bottom += heights
    for i, (_, parts) in enumerate(bars):
        if not parts:
            ax.text(i, 0, "not reported", ha="center", va="bottom", rotation=90)
    ax.set_xticks(x, [label for label, _ in bars], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("prompt tokens, all turns"
                  + (" (median of the runs)" if result.repeats > 1 else ""))
    ax.set_title("Prompt tokens by source, per engine")
    # Headroom above the tallest bar, so that the legend covers none.
    if bottom.any():
        ax.set_ylim(0, bottom.max() * 1.25)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", ncol=4)
    return _save(fig, path)


def frontier(result: BenchResult) -> list[tuple[float, float]]:
    """turnkv's (ITL p99, TTFT p50 after the first turn) points from the tightest ITL target
    to none: every `turnkv-itl<ms>` and `turnkv` that ran to the end, the path its
    `--itl-target-ms` moves it along."""
    points = []
    for agg in result.aggregates:
        ttft, itl = agg.figures["ttft_later_p50"], agg.figures["itl_p99"]
        target = itl_variant_target(agg.mode)
        if agg.mode != "turnkv" and target is None:
            continue
        if agg.status.state == "ok" and ttft.median is not None and itl.median is not None:
            points.append((math.inf if target is None else target, itl.median, ttft.median))
    return [(itl, ttft) for _, itl, ttft in sorted(points)]


def plot_ttft_vs_itl(result: BenchResult, path: Path) -> Path:
    """Each mode as a point: median TTFT after the first turn against ITL p99, the trade-off
    a deployment chooses from (lower left is better on both), with turnkv's `frontier`."""
    fig = Figure(figsize=(8, 5.5))
    ax = fig.subplots()
    itls: list[float] = []
    for agg in result.aggregates:
        ttft, itl = agg.figures["ttft_later_p50"], agg.figures["itl_p99"]
        if ttft.median is None or itl.median is None:
            continue
        ax.errorbar([itl.median], [ttft.median], xerr=_errors([itl]), yerr=_errors([ttft]),
                    fmt="o" if agg.status.state == "ok" else "x", capsize=3, label=legend(agg))
        ax.annotate(agg.mode, (itl.median, ttft.median), textcoords="offset points",
                    xytext=(5, 5), fontsize=8)
        itls.append(itl.median)
    line = frontier(result)
    if len(line) > 1:
        ax.plot(*zip(*line, strict=True), ":", color="grey",
                label="turnkv, ITL target tightest to none")
    # ITL p99 spans decode-only engines (a step) to engines stalled by prefills (seconds).
    if itls and min(itls) > 0 and max(itls) / min(itls) > 10:
        ax.set_xscale("log")
    ax.set_xlabel("ITL p99 at the client (ms)")
    ax.set_ylabel("TTFT p50 after the first turn (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"TTFT against ITL: {result.workload.name}{_runs_note(result)}", fontsize=10)
    ax.grid(alpha=0.3)
    _legend_if_any(ax)
    return _save(fig, path)


def _legend_if_any(ax: Axes) -> None:
    # A result with nothing to draw (every mode failed) gets an empty plot, not a warning.
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


PLOTS = ("ttft_by_turn.png", "ttft_cdf.png", "prompt_tokens_by_source.png", "ttft_vs_itl.png")


def write_plots(result: BenchResult, folder: Path) -> list[Path]:
    """Every plot into `folder`, named as docs/benchmarks.md links them (`PLOTS`)."""
    drawers = (plot_ttft_by_turn, plot_ttft_cdf, plot_prompt_sources, plot_ttft_vs_itl)
    return [draw(result, folder / name) for draw, name in zip(drawers, PLOTS, strict=True)]
