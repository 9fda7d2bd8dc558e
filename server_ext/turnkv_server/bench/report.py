"""Rendering a `BenchResult`: PNG plots, a rich table, and the markdown table for the docs.

A stalled or failed mode is labelled as such everywhere; its missing numbers print as "-",
never as 0, and its partial numbers stay marked by the status next to them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Figure objects without pyplot: no global state and no GUI backend; savefig renders with Agg.
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from rich.table import Table

from turnkv_server.bench.estimate import ESTIMATE_LABEL, MODES, ScenarioEstimate, TurnEstimate
from turnkv_server.bench.results import BenchResult, ModeStatus, ModeSummary, TokenTotals

# Stacked in this order, bottom up: reuse first, so the bar's top is what was recomputed.
# "reused" stands for cached + received where a mode reports only their sum (bidirectional).
SOURCES = ("cached", "received", "reused", "computed")


def status_label(status: ModeStatus) -> str:
    """'ok', or the state with its detail: 'stalled: no progress for 60 s'."""
    if status.state == "ok":
        return "ok"
    return f"{status.state}: {status.detail}" if status.detail else status.state


def _legend(summary: ModeSummary) -> str:
    if summary.status.state == "ok":
        return summary.mode
    return f"{summary.mode} ({summary.status.state})"


def plot_ttft_by_turn(result: BenchResult, path: Path) -> Path:
    """TTFT p50 by turn index per mode, with a band up to p90."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for s in result.summaries:
        points = [
            (t, p.p50, p.p90)
            for t, p in sorted(s.ttft_ms_by_turn.items())
            if p.p50 is not None and p.p90 is not None
        ]
        if not points:
            continue
        # 1-based on the axis, as in the tables of docs/benchmarks.md.
        turns, p50, p90 = (list(col) for col in zip(*points, strict=True))
        turns = [t + 1 for t in turns]
        style = "-" if s.status.state == "ok" else "--"
        (line,) = ax.plot(turns, p50, style, marker="o", label=_legend(s))
        ax.fill_between(turns, p50, p90, alpha=0.15, color=line.get_color())
    ax.set_xlabel("turn")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("TTFT at the client (ms); line p50, band to p90")
    ax.set_title(f"TTFT by turn: {result.workload.name}, {result.model}")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_ttft_cdf(result: BenchResult, path: Path) -> Path:
    """Empirical CDF of TTFT per mode, over the turns that finished without error."""
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for run, s in zip(result.runs, result.summaries, strict=True):
        ttft = np.sort([r.ttft_ms for r in run.records
                        if r.error is None and r.ttft_ms is not None])
        if ttft.size == 0:
            continue
        style = "-" if s.status.state == "ok" else "--"
        # From 0 at the fastest turn, so that a mode with a single turn still draws its step.
        x = np.concatenate([ttft[:1], ttft])
        y = np.arange(ttft.size + 1) / ttft.size
        ax.step(x, y, style, where="post", label=_legend(s))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT at the client (ms, log scale)")
    ax.set_ylabel("fraction of turns")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"TTFT CDF: {result.workload.name}, {result.model}")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return _save(fig, path)


def plot_prompt_sources(result: BenchResult, path: Path) -> Path:
    """Stacked bars per mode: prompt tokens the prefill engine found cached, received, computed.

    From the engines' own counters where they exported them (every vLLM engine does), else
    from the turns' stats; a mode with neither gets an empty slot labelled "not reported".
    """
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    modes = [_legend(s) for s in result.summaries]
    x = np.arange(len(modes))
    bottom = np.zeros(len(modes))
    parts = [source_parts(s.prefill_engine_tokens or s.prompt_tokens) for s in result.summaries]
    for source in SOURCES:
        heights = np.array([p.get(source, 0) for p in parts], dtype=float)
        if heights.any():
            label = f"prefill {source}" + (" (split not reported)" if source == "reused" else "")
            ax.bar(x, heights, bottom=bottom, label=label)
            bottom += heights
    for i, p in enumerate(parts):
        if not p:
            ax.text(i, 0, "not reported", ha="center", va="bottom", rotation=90)
    ax.set_xticks(x, modes, rotation=20, ha="right")
    ax.set_ylabel("prompt tokens, all turns")
    ax.set_title("Prompt tokens by source on the prefill engine")
    # Headroom above the tallest bar, so that the legend covers none.
    if bottom.any():
        ax.set_ylim(0, bottom.max() * 1.25)
    ax.legend(loc="upper center", ncol=4)
    return _save(fig, path)


def source_parts(tokens: TokenTotals) -> dict[str, int]:
    """The reported parts of the prefill engine's prompt tokens, nothing for unreported ones."""
    parts = {k: v for k in ("cached", "received", "computed")
             if (v := getattr(tokens, k)) is not None}
    if "cached" not in parts and "received" not in parts and tokens.reused is not None:
        parts["reused"] = tokens.reused
    return parts


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def write_plots(result: BenchResult, folder: Path) -> list[Path]:
    """All three plots into `folder`, named as docs/benchmarks.md links them."""
    return [
        plot_ttft_by_turn(result, folder / "ttft_by_turn.png"),
        plot_ttft_cdf(result, folder / "ttft_cdf.png"),
        plot_prompt_sources(result, folder / "prompt_tokens_by_source.png"),
    ]


COLUMNS = (
    "mode", "status", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "later TTFT p50 ms",
    "ITL p50 ms", "e2e p50 ms",
    "out tok/s", "recompute", "KV moved", "TTFT p50 vs base",
)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value} B"


def rows(result: BenchResult) -> list[list[str]]:
    """One row of formatted cells per mode, in COLUMNS order."""
    out = []
    for s in result.summaries:
        vs_base = result.ratios.get(s.mode, {}).get("ttft_p50")
        out.append([
            s.mode,
            status_label(s.status),
            _ms(s.ttft_ms.p50),
            _ms(s.ttft_ms.p90),
            _ms(s.ttft_ms.p99),
            _ms(s.ttft_ms_later.p50),
            _ms(s.itl_ms.p50),
            _ms(s.e2e_ms.p50),
            "-" if s.output_tokens_per_s is None else f"{s.output_tokens_per_s:.1f}",
            "-" if s.recompute_fraction is None else f"{s.recompute_fraction:.0%}",
            _bytes(s.kv_moved_bytes if s.kv_moved_bytes is not None else s.kv_to_decode_bytes),
            "-" if vs_base is None else f"{vs_base:.2f}x",
        ])
    return out


def rich_table(result: BenchResult) -> Table:
    """The summary as a rich table; non-ok modes in red."""
    table = Table(title=f"{result.workload.name} on {result.model}"
                  + (f" (baseline: {result.baseline})" if result.baseline else ""))
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("mode", "status") else "right")
    for s, row in zip(result.summaries, rows(result), strict=True):
        table.add_row(*row, style=None if s.status.state == "ok" else "red")
    return table


def markdown_table(result: BenchResult) -> str:
    """The same summary as a GitHub markdown table, for docs/benchmarks.md."""
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |"
              for row in rows(result)]
    return "\n".join(lines) + "\n"


def matrix_markdown(result: BenchResult) -> str:
    """Median TTFT after the first turn, each row's over each column's (below 1: row faster)."""
    modes = list(result.later_ttft_p50_matrix)
    body = [[row] + ["-" if (v := result.later_ttft_p50_matrix[row][col]) is None else f"{v:.2f}"
                     for col in modes] for row in modes]
    return _md(["row / column", *modes], body)


def ttft_by_turn_markdown(result: BenchResult) -> str:
    """Median TTFT (ms) per turn index, one column per mode (turns are 1-based here)."""
    turns = sorted({t for s in result.summaries for t in s.ttft_ms_by_turn})
    body = [[str(t + 1)] + [_ms(s.ttft_ms_by_turn[t].p50) if t in s.ttft_ms_by_turn else "-"
                            for s in result.summaries] for t in turns]
    return _md(["turn", *(s.mode for s in result.summaries)], body)


def summary_markdown(result: BenchResult) -> str:
    """Everything docs/benchmarks.md shows of a run: summary, per-turn TTFT, mode matrix."""
    status = "\n".join(f"- {s.mode}: {status_label(s.status)}" for s in result.summaries)
    return (f"{result.workload.name} (seed {result.workload.seed}, {result.workload.sessions} "
            f"sessions, {result.workload.turns} turns) on {result.model}, "
            f"{result.machine.cores} cores of {result.machine.cpu_model}\n\n"
            f"`{' '.join(result.command)}`\n\n{status}\n\n"
            f"{markdown_table(result)}\nMedian TTFT (ms) by turn:\n\n"
            f"{ttft_by_turn_markdown(result)}\nMedian TTFT after the first turn, row / column:"
            f"\n\n{matrix_markdown(result)}")


def _md(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines) + "\n"


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
