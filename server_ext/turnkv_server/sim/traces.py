"""Agent traces as JSONL, the simulator's own form: one line per turn.

    {"session": "s1", "turn": 0, "tokens_in": 1581, "tokens_out": 37, "tool_gap_s": 0.0,
     "start_s": 0.0, "parent": null, "prefix": "sys-a", "prefix_tokens": 1500}

- `session`, `turn` (0, 1, ...): the session and the turn's index in it;
- `tokens_in`: tokens the turn appends to the conversation (turn 0: its whole first prompt);
- `tokens_out`: tokens it decodes;
- `tool_gap_s`: seconds between the previous turn's end and this turn (the tool's or the
  user's time; 0 on turn 0);
- `start_s` (turn 0, optional): when the session starts, from the trace's start;
- `parent` (optional): the session that started this one (a subagent);
- `prefix`, `prefix_tokens` (turn 0, optional): a prefix shared with other sessions (a system
  prompt), which an engine that computed it for one session reuses for the next.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from turnkv_server.sim.sessions import SimSession, SimTurn


def read_trace(path: Path) -> list[SimSession]:
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows[str(row["session"])].append(row)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a trace line ({e})") from e
    return [_session(sid, sorted(turns, key=lambda r: int(r["turn"])))
            for sid, turns in rows.items()]


def _session(sid: str, rows: list[dict[str, Any]]) -> SimSession:
    if [int(r["turn"]) for r in rows] != list(range(len(rows))):
        raise ValueError(f"session {sid!r}: turns must be 0, 1, 2, ... without gaps")
    first = rows[0]
    turns = tuple(SimTurn(int(r["tokens_in"]), int(r["tokens_out"]),
                          0.0 if i == 0 else float(r.get("tool_gap_s") or 0.0))
                  for i, r in enumerate(rows))
    return SimSession(sid, turns, float(first.get("start_s") or 0.0), first.get("prefix"),
                      int(first.get("prefix_tokens") or 0), first.get("parent"))


def write_trace(sessions: Iterable[SimSession], path: Path) -> Path:
    with path.open("w", encoding="utf-8") as out:
        for s in sessions:
            for i, turn in enumerate(s.turns):
                row: dict[str, Any] = {"session": s.session_id, "turn": i,
                                       "tokens_in": turn.tokens_in,
                                       "tokens_out": turn.tokens_out,
                                       "tool_gap_s": turn.gap_s}
                if i == 0:
                    row.update(start_s=s.start_s, parent=s.parent, prefix=s.prefix,
                               prefix_tokens=s.prefix_tokens)
                out.write(json.dumps(row) + "\n")
    return path
