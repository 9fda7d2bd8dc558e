"""Rich tables for turn and session stats: `rich.print(turnkv.stats_table(session.turns))`,
`turnkv.turn_stats_table(turn.stats)`, `turnkv.session_stats_table(session.stats)`.

The stats models are data only: drawing them is this module's job, so it imports `stats` and
`stats` never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table

from turnkv.stats import SessionStats, TurnStats
from turnkv.turn import Turn


def _num(value: float | int | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


_UNBOUNDED = 100_000


class TurnsTable:
    """`stats_table`'s result, a rich renderable: every column where the console is wide
    enough for them all uncut, else a compact form (an 80-column terminal, a log file: rich
    draws 80 columns when its output is not a terminal) with the columns a reader needs
    first. `wide()` and `compact()` give either form as a `rich.table.Table`."""

    def __init__(self, turns: Iterable[Turn | TurnStats], title: str | None) -> None:
        self.stats = [item if isinstance(item, TurnStats) else item.stats for item in turns]
        self.title = title

    def wide(self) -> Table:
        """Prompt tokens by source, TTFT at the client and the router, router times, nodes."""
        table = Table(title=self.title)
        for name in ("turn", "prompt", "reused", "computed", "hit", "out", "client TTFT ms",
                     "router TTFT ms", "prefill ms", "total ms", "nodes", "notes"):
            table.add_column(name, justify="left" if name in ("nodes", "notes") else "right")
        for stats in self.stats:
            table.add_row(*_turn_row(stats))
        return table

    def compact(self) -> Table:
        """Prompt tokens by source (the hit ratio beside the reused count), output tokens, the
        client's TTFT (the router's where the client measured none) and the notes, which
        wrap; nodes and router times left out."""
        table = Table(title=self.title)
        for name in ("turn", "prompt", "reused", "computed", "out", "TTFT ms"):
            table.add_column(name, justify="right", no_wrap=True)
        table.add_column("notes", overflow="fold", ratio=1)
        for stats in self.stats:
            total, reused = stats.prompt_tokens.total, stats.reused_tokens
            hit = f" {reused / total:.0%}" if reused is not None and total else ""
            ttft = stats.client_ttft_ms
            if ttft is None and stats.served_by_turnkv:
                ttft = stats.times.first_token_ms
            table.add_row(str(stats.turn), _num(total), _num(reused) + hit,
                          _num(stats.computed_tokens), _num(stats.completion_tokens),
                          _num(ttft), ", ".join(_notes(stats)))
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = self.wide()
        # Measured without the console's limit, which `Measurement.get` would clamp it to.
        natural = Measurement.get(console, options.update_width(_UNBOUNDED), wide).maximum
        yield wide if natural <= options.max_width else self.compact()

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.wide())


def stats_table(turns: Iterable[Turn | TurnStats],
                title: str | None = "turnkv turns") -> TurnsTable:
    """One row per turn: prompt tokens by source, TTFT at the client and the router; compact
    where the console is narrow (`TurnsTable`)."""
    return TurnsTable(turns, title)


def _notes(stats: TurnStats) -> list[str]:
    notes = []
    if not stats.served_by_turnkv:
        notes.append("plain server")
    if stats.fallback:
        notes.append(f"fallback: {stats.fallback}")
    if stats.prefix_break_at is not None:
        notes.append(f"prefix break at token {stats.prefix_break_at:,}")
    if stats.retries:
        notes.append(f"{stats.retries} retries")
    return notes


def _turn_row(stats: TurnStats) -> list[str]:
    total = stats.prompt_tokens.total
    reused = stats.reused_tokens
    hit = f"{reused / total:.0%}" if reused is not None and total else "-"
    nodes = " -> ".join(n for n in (stats.prefill_node, stats.decode_node) if n) or "-"
    first_token = stats.times.first_token_ms
    return [str(stats.turn), _num(total), _num(reused), _num(stats.computed_tokens), hit,
            _num(stats.completion_tokens), _num(stats.client_ttft_ms, 1), _num(first_token, 1),
            _num(stats.times.prefill_ms if stats.served_by_turnkv else None, 1),
            _num(stats.times.total_ms if stats.served_by_turnkv else None, 1),
            nodes, ", ".join(_notes(stats))]


def turn_stats_table(stats: TurnStats) -> Table:
    """One turn's stats, a row per field (nested fields dotted: `prompt_tokens.total`)."""
    return _pairs(f"turn {stats.turn}", stats.model_dump())


def session_stats_table(stats: SessionStats) -> Table:
    """A session's totals, a row per field."""
    return _pairs(f"session {stats.session_id or ''}".strip(), stats.model_dump())


def _pairs(title: str, data: dict[str, Any], prefix: str = "") -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("field")
    table.add_column("value", justify="right")
    for key, value in _flatten(data, prefix):
        table.add_row(key, value)
    return table


def _flatten(data: dict[str, Any], prefix: str) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows.extend(_flatten(value, f"{name}."))
        elif isinstance(value, float):
            rows.append((name, f"{value:,.3f}"))
        else:
            rows.append((name, "-" if value is None else str(value)))
    return rows
