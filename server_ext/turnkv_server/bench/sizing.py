"""Token counts for sizing generated text, and cutting text to a token budget.

Generation only needs sizes, not exact tokenizations. `turnkv bench` counts with the served
model's own tokenizer (`tokenizer_counter`), because four characters per token, the fallback
for code that has no model at hand, undercounts this corpus by about a third, enough to push a
session past the model's context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path

TokenCounter = Callable[[str], int]

CHARS_PER_TOKEN = 4
# Chat templates wrap every message in a few tokens of role markers (ChatML: about 4-5).
MESSAGE_OVERHEAD_TOKENS = 6


def approx_tokens(text: str) -> int:
    """Estimated tokens of `text`: one per four characters, rounded up."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def tokenizer_counter(model_dir: Path) -> TokenCounter:
    """Exact token counts from the tokenizer in a local model folder (never a download).

    Counts are cached: generation counts the same system prompt and turns many times over.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)

    @lru_cache(maxsize=4096)
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count


def take_tokens(lines: Iterable[str], target: int, count: TokenCounter = approx_tokens) -> str:
    """Join `lines` (newline-separated) until the text holds `target` tokens, cutting the last.

    With `approx_tokens` the result has exactly `target` tokens; with a real tokenizer it may
    end a token or two short, because a cut can merge or split tokens.
    """
    if target < 1:
        raise ValueError(f"target must be at least 1 token, not {target}")
    parts: list[str] = []
    estimate = 0
    size = 0
    for line in lines:
        parts.append(line)
        # Summing per-line counts is cheap and never below the joined count for the default
        # counter; the joined text is counted only once the sum says it may be enough.
        estimate += count(line) + 1
        if estimate < target:
            continue
        size = count("\n".join(parts))
        if size >= target:
            break
        estimate = size
    text = "\n".join(parts)
    size = count(text)
    if size < target:
        raise ValueError(f"the lines ran out at {size} of {target} tokens")
    return _cut(text, size, target, count)


def _cut(text: str, size: int, target: int, count: TokenCounter) -> str:
    # Shrink in proportion, then by single characters: a few counts even for a real tokenizer.
    while size > target and text:
        excess = max(1, (size - target) * len(text) // size)
        text = text[: len(text) - excess]
        size = count(text)
    return text
