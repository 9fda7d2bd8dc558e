"""A converter from Mooncake's published request traces (kvcache-ai/Mooncake, FAST'25 traces:
`conversation_trace.jsonl`, `toolagent_trace.jsonl`) to the simulator's sessions.

Each line of such a trace is one request: `timestamp` (ms from the trace's start),
`input_length` and `output_length` (tokens) and `hash_ids`, one ID per 512-token block of the
prompt, equal IDs for equal prefixes. Sessions are not named, so they are found: a request
whose blocks start with all of an open session's last request's blocks is that session's next
turn (the longest such match wins); any other request starts a session, whose prefix shared
with earlier requests (a system prompt) is kept as its shared prefix.

What the trace does not hold is estimated: a turn's new tokens are its prompt less the
previous prompt and output, and the gap before it is the time between the two requests'
arrivals (the previous turn's own time included: an upper bound of the tool's time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from turnkv_server.sim.sessions import SimSession, SimTurn

MOONCAKE_BLOCK_TOKENS = 512


@dataclass
class _Open:
    sid: str
    start_ms: float
    prefix: str | None
    prefix_tokens: int
    turns: list[SimTurn] = field(default_factory=list)
    last_ms: float = 0.0
    context: int = 0


def read_mooncake(path: Path) -> list[SimSession]:
    requests = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    requests.append((float(row["timestamp"]), int(row["input_length"]),
                                     int(row["output_length"]), tuple(row["hash_ids"])))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{number}: not a Mooncake trace line ({e})") from e
    requests.sort(key=lambda r: r[0])
    sessions: list[_Open] = []
    by_last: dict[tuple[int, ...], _Open] = {}  # an open session, by its last prompt's blocks
    seen: set[tuple[int, ...]] = set()  # every prompt's block prefixes so far
    for at, tokens_in, tokens_out, blocks in requests:
        found = next((by_last.pop(blocks[:k]) for k in range(len(blocks), 0, -1)
                      if blocks[:k] in by_last), None)
        if found is None:
            shared = max((k for k in range(1, len(blocks) + 1) if blocks[:k] in seen),
                         default=0)
            found = _Open(f"mooncake-{len(sessions):06d}", at,
                          f"blocks-{hash(blocks[:shared]) & 0xffffffff:08x}" if shared else None,
                          min(shared * MOONCAKE_BLOCK_TOKENS, tokens_in))
            sessions.append(found)
        gap = 0.0 if not found.turns else max(0.0, (at - found.last_ms) / 1000)
        found.turns.append(SimTurn(max(1, tokens_in - found.context), max(1, tokens_out), gap))
        found.context = max(tokens_in, found.context) + tokens_out
        found.last_ms = at
        by_last[blocks] = found
        seen.update(blocks[:k] for k in range(1, len(blocks) + 1))
    origin = requests[0][0] if requests else 0.0
    return [SimSession(s.sid, tuple(s.turns), (s.start_ms - origin) / 1000, s.prefix,
                       s.prefix_tokens) for s in sessions]
