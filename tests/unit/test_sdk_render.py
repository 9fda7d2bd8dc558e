"""`turnkv.stats_table` at any width: every column where they all fit uncut, else a compact form
whose cells are never cut (an 80-column terminal, or a log file, where rich draws 80 columns)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import turnkv
from turnkv import protocol as p


def turns() -> list[turnkv.TurnStats]:
    """A long session's turns: five-digit token counts, every kind of note."""
    out = []
    for turn in range(1, 13):
        total = 2_500 * turn
        wire = p.RouterTurnStats(
            session_id="s", turn=turn, mode="turnkv", prefill_node="prefill-0",
            decode_node="decode-0", completion_tokens=96,
            prompt_tokens=p.PromptTokens(total=total, prefill_computed=140,
                                         prefill_reused=total - 140),
            times=p.TurnTimes(prefill_ms=812.4, first_token_ms=1_020.7, total_ms=9_870.2),
            prefix_break_at=1_641 if turn == 4 else None,
            fallback="transfer_failed" if turn == 5 else None)
        out.append(turnkv.TurnStats.from_wire(wire, client_ttft_ms=1_041.5,
                                              retries=2 if turn == 6 else 0))
    out.append(turnkv.TurnStats.from_usage({"prompt_tokens": 10}, session_id="s", turn=13))
    return out


def draw(console: Console) -> str:
    console.print(turnkv.stats_table(turns(), title="session s: per turn"))
    return console.export_text() if console.record else ""


def test_narrow_consoles_get_the_compact_form_with_no_cell_cut() -> None:
    out = draw(Console(width=80, record=True))
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in out
    header = next(line for line in lines if "turn" in line and "prompt" in line)
    assert header.split("┃")[1:-1] == [" turn ", " prompt ", "      reused ", " computed ",
                                       " out ", " TTFT ms ", " notes               "]
    row = next(line for line in lines if line.startswith("│    4 "))
    assert [cell.strip() for cell in row.split("│")[1:-1]] == [
        "4", "10,000", "9,860 99%", "140", "96", "1,042", "prefix break at"]
    text = " ".join(" ".join(out.split()).split("│"))
    for note in ("token 1,641", "transfer_failed", "2 retries", "plain server"):
        assert note in text


def test_a_log_file_gets_the_compact_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a terminal: rich draws 80 columns (unless COLUMNS says otherwise), and so does the
    table."""
    monkeypatch.delenv("COLUMNS", raising=False)
    buffer = io.StringIO()
    draw(Console(file=buffer, width=None, force_terminal=False))
    out = buffer.getvalue()
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    assert "TTFT ms" in out and "router TTFT ms" not in out


def test_wide_consoles_get_every_column() -> None:
    out = draw(Console(width=200, record=True))
    assert "…" not in out and "router TTFT ms" in out and "prefill-0 -> decode-0" in out
    assert max(len(line) for line in out.splitlines()) < 200
    table = turnkv.stats_table(turns())
    assert len(table.wide().columns) == 12 and len(table.compact().columns) == 7
