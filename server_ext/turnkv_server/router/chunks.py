"""What the router reads and changes in an engine's answer, chunk by chunk or whole: the
token IDs it asked for (stripped unless the client asked too), whether a chunk carries output,
and the usage a streamed turn's client asked for.
"""

from __future__ import annotations

from typing import Any

# The routes whose streams take `stream_options.include_usage` (vLLM's and OpenAI's).
USAGE_PATHS = ("/v1/chat/completions", "/v1/completions")


def ask_usage(path: str, body: dict[str, Any]) -> bool:
    """Whether the client of a streamed turn asked for usage; asks the engine for it anyway
    (in `body`, on the routes that take `stream_options`): the stats count the turn's tokens
    and take the engine's timing from its usage chunk."""
    options = body.get("stream_options")
    asked = isinstance(options, dict) and bool(options.get("include_usage"))
    if path in USAGE_PATHS and (options is None or isinstance(options, dict)):
        body["stream_options"] = {**(options or {}), "include_usage": True}
    return asked


def strip_token_ids(data: dict[str, Any]) -> None:
    data.pop("prompt_token_ids", None)
    for choice in data.get("choices") or []:
        choice.pop("token_ids", None)


def has_output(chunk: dict[str, Any]) -> bool:
    return any(choice.get("text") or choice.get("token_ids") or any(
        (choice.get("delta") or {}).get(key) for key in ("content", "tool_calls", "reasoning"))
        for choice in chunk.get("choices") or [])
