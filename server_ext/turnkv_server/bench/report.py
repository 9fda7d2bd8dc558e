"""Rendering a `BenchResult` as tables: a rich table for the terminal, markdown for
summary.md and the docs (the plots are in `plots`).

Each mode's row is its aggregate: with `--repeat N`, a cell is the median of the runs'
figures followed by their range, "1,234 (1,100-1,400)", and a ratio is the ratio of the
medians followed by the range of the per-repeat ratios. A stalled or failed mode is labelled
as such everywhere; its missing numbers print as "-", never as 0.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.table import Table

from turnkv_server.bench.estimate import ESTIMATE_LABEL, MODES, ScenarioEstimate, TurnEstimate
from turnkv_server.bench.results import BenchResult, ModeStatus, Spread, TokenTotals
from turnkv_server.bench.summary import STALL_FACTOR


def status_label(status: ModeStatus) -> str:
    """'ok', or the state with its detail: 'stalled: no progress for 60 s'."""
    if status.state == "ok":
        return "ok"
    return f"{status.state}: {status.detail}" if status.detail else status.state


Cell = Callable[[float], str]


def _ms(value: float) -> str:
    return f"{value:,.0f}"


def _rate(value: float) -> str:
    return f"{value:.1f}"


def _share(value: float) -> str:
    return f"{value:.0%}"


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def cell(spread: Spread | None, fmt: Cell) -> str:
    """The median, then the range when more than one run reported it; "-" when none did."""
    if spread is None or spread.median is None:
        return "-"
    text = fmt(spread.median)
    if spread.n > 1 and spread.min is not None and spread.max is not None:
        text += f" ({fmt(spread.min)}-{fmt(spread.max)})"
    return text


def ratio_cell(value: float | None, spread: Spread | None, unit: str = "x") -> str:
    """A ratio of medians, then the range of the per-repeat ratios when there are several."""
    if value is None:
        return "-"
    if spread is None or spread.n < 2 or spread.min is None or spread.max is None:
        return f"{value:.2f}{unit}"
    return f"{value:.2f}{unit} ({spread.min:.2f}-{spread.max:.2f})"


def status_cell(status: ModeStatus, runs: int, runs_ok: int) -> str:
    """The mode's status; with several runs, how many finished."""
    if runs == 1:
        return status_label(status)
    if runs_ok == runs:
        return f"ok, {runs} runs"
    # The detail names each run that did not finish, and why.
    if runs_ok:
        return f"ok in {runs_ok} of {runs} runs ({status.detail})"
    return f"{status.state} in all {runs} runs ({status.detail})"


# Column -> (figure, format), in the order of the summary table.
FIGURE_COLUMNS: dict[str, tuple[str, Cell]] = {
    "TTFT p50 ms": ("ttft_p50", _ms),
    "TTFT p90 ms": ("ttft_p90", _ms),
    "TTFT p99 ms": ("ttft_p99", _ms),
    "later TTFT p50 ms": ("ttft_later_p50", _ms),
    "later TTFT p90 ms": ("ttft_later_p90", _ms),
    "ITL p50 ms": ("itl_p50", _ms),
    "ITL p99 ms": ("itl_p99", _ms),
    "ITL stalled": ("itl_stall_share", _share),
    "e2e p50 ms": ("e2e_p50", _ms),
    "out tok/s": ("output_tokens_per_s", _rate),
    "recompute": ("recompute_fraction", _share),
    "computed, all engines": ("engines_computed", _count),
    "KV moved": ("kv_moved_bytes", _bytes),
}
RATIO_COLUMNS = {"TTFT p50 vs base": "ttft_p50", "later TTFT p50 vs base": "ttft_later_p50"}
COLUMNS = ("mode", "status", *FIGURE_COLUMNS, *RATIO_COLUMNS, "engines x cores")

NOTES = (f"Later: the turns after each session's first. ITL: the gaps between output chunks at "
         f"the client; ITL stalled: the share of them longer than {STALL_FACTOR:g}x the run's "
         f"median gap (decode steps that waited behind prompt work). Computed, all engines: "
         f"prompt tokens every engine computed, by its own counters.")


def layout_cell(result: BenchResult, mode: str) -> str:
    """"2x1": the mode's engines x cores each, as its runs recorded (`plan.layout`); "-" in
    results from before they did."""
    config = next((r.config for r in result.runs if r.mode == mode), {})
    engines, cores = config.get("engine_count"), config.get("cores_per_engine")
    return "-" if engines is None or cores is None else f"{engines}x{cores}"


def rows(result: BenchResult) -> list[list[str]]:
    """One row of formatted cells per mode (its aggregate), in COLUMNS order."""
    out = []
    for agg in result.aggregates:
        ratios = result.ratios.get(agg.mode, {})
        spreads = result.ratio_spread.get(agg.mode, {})
        out.append([
            agg.mode, status_cell(agg.status, agg.runs, agg.runs_ok),
            *(cell(agg.figures.get(figure), fmt) for figure, fmt in FIGURE_COLUMNS.values()),
            *(ratio_cell(ratios.get(metric), spreads.get(metric))
              for metric in RATIO_COLUMNS.values()),
            layout_cell(result, agg.mode),
        ])
    return out


def rich_table(result: BenchResult) -> Table:
    """The summary as a rich table; modes that did not finish every run in red."""
    runs = f", median of {result.repeats} runs (min-max)" if result.repeats > 1 else ""
    table = Table(title=f"{result.workload.name} on {result.model}"
                  + (f" (baseline: {result.baseline}{runs})" if result.baseline else runs),
                  caption=NOTES)
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("mode", "status") else "right")
    for agg, row in zip(result.aggregates, rows(result), strict=True):
        table.add_row(*row, style=None if agg.runs_ok == agg.runs else "red")
    return table


def _md(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def markdown_table(result: BenchResult) -> str:
    """The same summary as a GitHub markdown table, for docs/benchmarks.md."""
    return _md(list(COLUMNS), rows(result))


def ratios_markdown(result: BenchResult) -> str:
    """Every ratio against the baseline: the ratio of the medians, the per-repeat range."""
    metrics = list(next(iter(result.ratios.values()), {}))
    body = [[mode] + [ratio_cell(result.ratios[mode].get(m),
                                 result.ratio_spread.get(mode, {}).get(m)) for m in metrics]
            for mode in result.ratios]
    return _md(["mode", *metrics], body)


def runs_markdown(result: BenchResult) -> str:
    """Every run on its own, in the order they ran: what the medians above combine."""
    header = ["run", "mode", "status", "wall s", "TTFT p50 ms", "later TTFT p50 ms",
              "ITL p50 ms", "ITL p99 ms", "ITL stalled", "out tok/s"]

    def fmt(value: float | None, formatter: Cell) -> str:
        return "-" if value is None else formatter(value)

    body = [[str(s.repeat + 1), s.mode, status_label(s.status), fmt(s.wall_s, _ms),
             fmt(s.ttft_ms.p50, _ms), fmt(s.ttft_ms_later.p50, _ms), fmt(s.itl_ms.p50, _ms),
             fmt(s.itl_ms.p99, _ms), fmt(s.itl_stall_share, _share),
             fmt(s.output_tokens_per_s, _rate)] for s in result.summaries]
    return _md(header, body)


def matrix_markdown(result: BenchResult) -> str:
    """Median TTFT after the first turn, each row's over each column's (below 1: row faster)."""
    modes = list(result.later_ttft_p50_matrix)

    def ratio(row: str, col: str) -> str:
        spread = result.later_ttft_p50_matrix_spread.get(row, {}).get(col)
        return ratio_cell(result.later_ttft_p50_matrix[row][col], spread, unit="")

    return _md(["row / column", *modes], [[row] + [ratio(row, col) for col in modes]
                                          for row in modes])


def ttft_by_turn_markdown(result: BenchResult) -> str:
    """Median TTFT (ms) per turn index, one column per mode (turns are 1-based here)."""
    turns = sorted({t for a in result.aggregates for t in a.ttft_p50_by_turn})
    body = [[str(t + 1)] + [cell(a.ttft_p50_by_turn.get(t), _ms) for a in result.aggregates]
            for t in turns]
    return _md(["turn", *(a.mode for a in result.aggregates)], body)


def engine_tokens_markdown(result: BenchResult) -> str:
    """Per mode, each engine's prompt tokens by source and the engines' total."""
    def counts(tokens: TokenTotals) -> list[str]:
        return ["-" if (v := getattr(tokens, f)) is None else f"{v:,}"
                for f in ("cached", "received", "computed", "total")]

    body = []
    for agg in result.aggregates:
        body += [[agg.mode, engine, *counts(t)] for engine, t in agg.engine_tokens.items()]
        if agg.all_engines_tokens is not None and len(agg.engine_tokens) > 1:
            body.append([agg.mode, "all engines", *counts(agg.all_engines_tokens)])
    return _md(["mode", "engine", "cached", "received", "computed", "total"], body)


def summary_markdown(result: BenchResult) -> str:
    """Everything docs/benchmarks.md shows of a run: summary, ratios, per-turn TTFT, prompt
    tokens per engine, mode matrix; with repeats, every run too."""
    status = "\n".join(
        f"- {s.mode}" + (f", run {s.repeat + 1}" if result.repeats > 1 else "")
        + f": {status_label(s.status)}" for s in result.summaries)
    runs = (f", each mode {result.repeats} times, interleaved: a cell is the median of the "
            f"runs, then their range (min-max); a ratio is the ratio of the medians, then the "
            f"range of the per-repeat ratios" if result.repeats > 1 else "")
    parts = [
        f"{result.workload.name} (seed {result.workload.seed}, {result.workload.sessions} "
        f"sessions, {result.workload.turns} turns) on {result.model}, "
        f"{result.machine.cores} cores of {result.machine.cpu_model}{runs}\n",
        f"`{' '.join(result.command)}`\n", status + "\n", markdown_table(result), NOTES + "\n",
    ]
    if result.ratios:
        parts.append(f"Against {result.baseline}:\n\n{ratios_markdown(result)}")
    if result.repeats > 1:
        parts.append(f"Every run, in the order they ran:\n\n{runs_markdown(result)}")
    parts += [f"Median TTFT (ms) by turn:\n\n{ttft_by_turn_markdown(result)}",
              "Prompt tokens by engine and source (each engine's own counters"
              + (", median of the runs" if result.repeats > 1 else "")
              + f"):\n\n{engine_tokens_markdown(result)}",
              f"Median TTFT after the first turn, row / column:\n\n{matrix_markdown(result)}"]
    return "\n".join(parts)

def estimate_turns_markdown(rows: list[TurnEstimate]) -> str:
    """Per turn: prompt tokens, each mode's estimated TTFT, and its speedup over the baseline."""
    header = ["turn", "prompt tokens"] + [f"{m} ms" for m in MODES] + [f"{m} x" for m in MODES]
    body = [
        [str(r.turn + 1), str(r.prompt_tokens)]
        + [f"{r.ttft_ms[m]:.0f}" for m in MODES]
        + [f"{r.speedup_vs_baseline[m]:.2f}" for m in MODES]
        for r in rows
    ]
    return f"{ESTIMATE_LABEL}\n\n" + _md(header, body)


def estimate_summary_markdown(scenarios: list[ScenarioEstimate]) -> str:
    """Estimated speedups over prefill-cache-off P/D beside vLLM's published figures."""
    header = [
        "model, context", "reading", "MFU", "link efficiency", "fixed ms",
        "bidirectional (est.)", "turnkv (est.)", "bidirectional (vLLM, published)",
    ]
    body = [
        [
            f"{s.published.model}, {s.published.context_tokens // 1000}k",
            s.reading,
            f"{s.cluster.mfu:.0%}",
            f"{s.cluster.link_efficiency:.1%}",
            f"{s.cluster.fixed_ms:.0f}",
            f"{s.speedup('bidirectional'):.2f}x",
            f"{s.speedup('turnkv'):.2f}x",
            f"{s.published.ttft_speedup:.1f}x",
        ]
        for s in scenarios
    ]
    return f"{ESTIMATE_LABEL}; median over the turns after the first\n\n" + _md(header, body)
