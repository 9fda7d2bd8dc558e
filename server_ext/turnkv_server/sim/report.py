"""A simulation's outputs: results.json, a markdown table (summary.md) and PNG plots, drawn
as the bench draws its own (`bench.plots`: Figure objects, no pyplot)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.md"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def summary_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    head = ("| policy | turns | hit rate | TTFT p50 ms | TTFT later p50 | TTFT p99 | ITL p50 ms "
            "| ITL p99 | KV moved Mtok | tier read Mtok | prefill util | decode util |")
    lines = [head, "|" + "---|" * 12]
    for s in summaries:
        load = s.get("sessions_per_engine")
        label = s["label"] if load is None else f"{s['label']}, {load}/engine"
        lines.append(
            f"| {label} | {s['turns']} | {_pct(s['hit_rate'])} "
            f"| {_ms(s['ttft_ms']['p50'])} | {_ms(s['ttft_ms_later']['p50'])} "
            f"| {_ms(s['ttft_ms']['p99'])} | {_ms(s['itl_ms']['p50'])} "
            f"| {_ms(s['itl_ms']['p99'])} | {s['kv_moved_tokens'] / 1e6:.2f} "
            f"| {s['tier_read_tokens'] / 1e6:.2f} | {_pct(s['utilisation']['prefill'])} "
            f"| {_pct(s['utilisation']['decode'])} |")
    return "\n".join(lines) + "\n"


def validation_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| workload | mode | bench run | bench TTFT later p50 ms | its runs | sim | error "
             "| bench hit rate | sim | error |", "|" + "---|" * 10]
    for r in rows:
        b, s, e = r["bench"], r["sim"], r["error"]
        if s is None:
            lines.append(f"| {r['workload']} | {r['mode']} | {r['source']} | no bench data "
                         f"| | | | | | |")
            continue
        spread = b.get("ttft_later_p50_range_ms")
        runs = f"{_ms(spread[0])}-{_ms(spread[1])}" if spread else "-"
        lines.append(
            f"| {r['workload']} | {r['mode']} | {r['source']} "
            f"| {_ms(b['ttft_later_p50_ms'])} "
            f"| {runs} "
            f"| {_ms(s['ttft_later_p50_ms'])} "
            f"| {_signed(e['ttft_later_p50_ms'])} | {_pct(b['hit_rate'])} "
            f"| {_pct(s['hit_rate'])} | {_signed(e['hit_rate'])} |")
    return "\n".join(lines) + "\n"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def write_results(out: Path, payload: Mapping[str, Any], table: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS_FILE
    results.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    summary = out / SUMMARY_FILE
    summary.write_text(table, encoding="utf-8")
    return [results, summary]


def plot_ttft_cdf(ttfts: Mapping[str, Sequence[float]], path: Path) -> Path:
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for label, values in ttfts.items():
        if values:
            xs = np.sort(np.asarray(values, dtype=float))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("share of turns")
    ax.set_title("TTFT by policy (simulated)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_curves(points: Sequence[Mapping[str, Any]], x_key: str, x_label: str,
                path: Path, title: str) -> Path:
    """Hit rate and TTFT after the first turn (p50) against `x_key`, one line per policy."""
    fig = Figure(figsize=(11, 4.5))
    hit_ax, ttft_ax = fig.subplots(1, 2)
    for label in dict.fromkeys(p["label"] for p in points):
        mine = sorted((p for p in points if p["label"] == label), key=lambda p: p[x_key])
        xs = [p[x_key] for p in mine]
        hit_ax.plot(xs, [p["hit_rate"] for p in mine], marker="o", label=label)
        ttft_ax.plot(xs, [p["ttft_ms_later"]["p50"] for p in mine], marker="o", label=label)
    hit_ax.set_ylabel("prefix hit rate")
    ttft_ax.set_ylabel("TTFT after the first turn, p50 (ms, log)")
    ttft_ax.set_yscale("log")
    for ax in (hit_ax, ttft_ax):
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    hit_ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
