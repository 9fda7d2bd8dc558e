"""vLLM's `/v1/chat/completions` answer with token IDs, for engine stand-ins (aiohttp servers
that play an engine behind the router): the whole answer, or the stream as vLLM sends it (a
role chunk with the prompt's token IDs, a chunk a token, the usage chunk, `[DONE]`).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

PROMPT = [7, 8, 9]
OUTPUT = [11, 12, 13, 14]
USAGE = {"prompt_tokens": len(PROMPT), "completion_tokens": len(OUTPUT),
         "total_tokens": len(PROMPT) + len(OUTPUT), "prompt_tokens_details": {"cached_tokens": 0}}


def sse_event(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def whole_answer() -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "prompt_token_ids": PROMPT, "usage": USAGE,
            "choices": [{"index": 0, "finish_reason": "stop", "token_ids": OUTPUT,
                         "message": {"role": "assistant", "content": "a b c d"}}],
            "kv_transfer_params": {"turnkv": {"local_tokens": 0}}}


async def answer_chat(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """The answer to `body`: whole, or streamed where it asks for a stream."""
    if not body.get("stream"):
        return web.Response(content_type="application/json", body=orjson.dumps(whole_answer()))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m"}
    await response.write(sse_event({**base, "prompt_token_ids": PROMPT, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}))
    for token in OUTPUT:
        await response.write(sse_event({**base, "choices": [
            {"index": 0, "delta": {"content": f"t{token}"}, "token_ids": [token]}]}))
    await response.write(sse_event({**base, "choices": [], "usage": USAGE}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
