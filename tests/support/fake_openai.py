"""An in-process OpenAI-shaped responder for the SDK's unit tests (httpx.MockTransport).

Only for pure SDK logic (tagging, recording, retries); everything that needs a server's real
behaviour is tested against real engines in tests/integration/.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class FakeServer:
    """Answers chat completions; `turnkv=False` plays a plain server. `fail_first` answers
    the first N turn requests with this status (and Retry-After: 0)."""

    turnkv: bool = True
    fail_first: int = 0
    fail_status: int = 503
    cached_tokens: int | None = 3
    requests: list[httpx.Request] = field(default_factory=list)
    # The http library whose Response to answer with: httpx, or httpx2 (openai 3's own).
    library: Any = httpx

    def tags(self) -> list[dict[str, str]]:
        return [{k: v for k, v in r.headers.items() if k.startswith("x-turnkv")}
                for r in self.requests]

    def __call__(self, request: Any) -> Any:
        self.requests.append(request)
        if self.fail_first > 0:
            self.fail_first -= 1
            return self.library.Response(self.fail_status, json={"error": {"message": "busy"}},
                                  headers={"retry-after": "0", "retry-after-ms": "1"})
        body = json.loads(request.content)
        tag = {k.lower(): v for k, v in request.headers.items()}
        usage: dict[str, Any] = {"prompt_tokens": 20, "completion_tokens": 2,
                                 "total_tokens": 22}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        stats = {"session_id": tag.get("x-turnkv-session"),
                 "turn": int(tag.get("x-turnkv-turn", "1")), "mode": "bidirectional",
                 "prefill_node": "prefill-0", "decode_node": "decode-0",
                 "prompt_tokens": {"total": 20, "prefill_reused": 15, "prefill_computed": 5},
                 "completion_tokens": 2,
                 "times": {"prefill_ms": 10.0, "first_token_ms": 12.0, "total_ms": 30.0}}
        headers = {"x-turnkv-session": stats["session_id"] or "", "x-turnkv-turn":
                   str(stats["turn"])} if self.turnkv and stats["session_id"] else {}
        if body.get("stream"):
            base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
            chunks: list[dict[str, Any]] = [
                {**base, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                             "content": "Hel"}}]},
                {**base, "choices": [{"index": 0, "delta": {"content": "lo"},
                                      "finish_reason": "stop"}]},
                {**base, "choices": [], "usage": usage},
            ]
            if self.turnkv and stats["session_id"]:
                chunks.append({**base, "choices": [], "turnkv": stats})
            events = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks]
            # Arrives in pieces, as from a network: the SDK must read it as it streams.
            pieces = [e[i:i + 17] for e in [*events, b"data: [DONE]\n\n"]
                      for i in range(0, len(e), 17)]
            return self.library.Response(200, content=iter(pieces),
                                  headers={**headers, "content-type": "text/event-stream"})
        data: dict[str, Any] = {
            "id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "Hello"}}],
            "usage": usage}
        if self.turnkv and stats["session_id"]:
            data["turnkv"] = stats
        return self.library.Response(200, json=data, headers=headers)
