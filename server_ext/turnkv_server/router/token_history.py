"""A prompt against a session's token history (the last turn's prompt and output token IDs, as
the engines computed them): how much of it the prompt repeats, and where it stops repeating
it. Reused KV is right only up to there."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in slices first: histories are thousands of tokens and usually match entirely.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_break(history: Sequence[int], prompt: Sequence[int]) -> int | None:
    """The first position where ``prompt`` stops following ``history``, or None if it repeats
    all of it. A prompt shorter than the history breaks at its own length at the latest."""
    matched = common_prefix_len(history, prompt)
    return None if matched == len(history) else matched
