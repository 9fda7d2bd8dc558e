"""What the demo prints, in words a user reads without knowing turnkv: what the run shows, the
hints the agent sends, where each turn's prompt tokens came from, and why a turn's prompt
stopped matching the session's history (a prefix break) and what that cost.
"""

from __future__ import annotations

import turnkv


def intro(folder: str, questions: int) -> str:
    return (
        f"What this demo shows: one agent session. The model answers {questions} "
        f"question{'s' if questions != 1 else ''} about the files in {folder}, calling a "
        "tool (read a file, search the files) between turns.\n"
        "Like any chat agent, it resends the whole conversation every turn: the system "
        "prompt, the earlier questions, tool results and replies, then the new part. turnkv "
        "keeps the session's KV cache (what the engines computed for those tokens) between "
        "turns, so a turn reuses its history and computes only what is new.\n"
        "Before each tool run the agent tells the router when its next turn will come; when "
        "it is done, it tells the router that the session ends. After each turn a line shows "
        "how long the first token took and how many prompt tokens were reused or computed; "
        "the tables at the end sum it up.")


def duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 0.001:
        return f"{seconds * 1000:.3g} ms"
    return "under 1 ms"


def hint(next_turn_in: float, tool: str) -> str:
    return (f"told the router: next turn in ~{duration(next_turn_in)}, after {tool} runs "
            "(so it keeps the session's cache at least that long)")


def final_note() -> str:
    return "last turn: it tells the router to end the session"


def turn_line(stats: turnkv.TurnStats) -> str:
    """Time to first token and where the prompt's tokens came from."""
    ttft = "" if stats.client_ttft_ms is None else (
        f"first token after {duration(stats.client_ttft_ms / 1000)}; ")
    total = stats.prompt_tokens.total
    line = f"{ttft}prompt {total:,} tokens"
    reused, computed = stats.reused_tokens, stats.computed_tokens
    if reused is not None and computed is not None:
        line += f": {reused:,} reused from cache, {computed:,} computed"
    # (In affinity mode every turn is computed where it is decoded: nothing to point out.)
    if stats.mode == "turnkv" and stats.prefill_node is None and stats.decode_node:
        line += " (a short addition: the decode engine computed it alone)"
    if stats.fallback:
        detail = f" ({stats.fallback_detail})" if stats.fallback_detail else ""
        line += f"; fallback: {stats.fallback}{detail}"
    return line


def prefix_break(stats: turnkv.TurnStats, previous: turnkv.TurnStats | None) -> str | None:
    """Why this turn's prompt stopped following the history the engines hold (the last
    turn's prompt and reply, as tokens), and what it cost; None if it did not."""
    at = stats.prefix_break_at
    if at is None:
        return None
    if previous is not None and at >= previous.prompt_tokens.total:
        why = ("It is inside the model's last reply: sent back as text, the reply became "
               "other tokens than the ones the model generated (the same text, split into "
               "tokens differently).")
    elif previous is not None:
        why = ("It is before the last reply: an earlier message changed (edited or trimmed "
               "by the client, or written differently by the chat template).")
    else:
        why = ""
    total = stats.prompt_tokens.total
    return (f"prefix break at token {at:,} of {total:,}: from there on, the prompt differs "
            f"from the history the engines hold (the last turn's prompt and reply). {why} "
            f"The cache cannot serve past that token: the {total - at:,} tokens after it had "
            "to be computed.").replace("  ", " ")


LEGEND = (
    "reused: prompt tokens whose KV came from the cache (earlier turns of the session), "
    "not computed again; computed: prompt tokens computed for this turn (reuse comes in "
    "whole KV blocks, so a partly filled last block is computed again); out: tokens "
    "generated; TTFT: time to the reply's first token, measured by the client; prefix "
    "break: where the prompt stopped matching the session's history (see the turn's line "
    "above).")
