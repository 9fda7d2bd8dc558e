"""One finished turn: the answer and its stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turnkv.stats import TurnStats


@dataclass
class Turn:
    """`response` is the openai `ChatCompletion` (or `Completion`) of a non-streamed turn and
    None for a streamed one; `message` is the assistant message either way (None for
    `/completions`); `text` its content."""

    index: int
    stats: TurnStats
    text: str = ""
    message: Any = None
    response: Any = None

    def model_dump(self) -> dict[str, Any]:
        return {"index": self.index, "text": self.text, "stats": self.stats.model_dump()}
