"""What the server can do, asked once before the session starts."""

from __future__ import annotations

from dataclasses import dataclass

import openai


@dataclass(frozen=True)
class ServerInfo:
    model: str
    is_vllm: bool  # vLLM takes `structured_outputs`, which can hold replies to the format
    native_tools: bool  # the server answers `tools` with `tool_calls`


def probe(client: openai.OpenAI, model: str | None, tool_format: str) -> ServerInfo:
    """`tool_format`: "native", "text" or "auto" (native where the server accepts `tools`:
    vLLM refuses them with a 400 unless it runs with a tool parser)."""
    models = client.models.list().data
    if not models and model is None:
        raise SystemExit("the server lists no models: pass --model")
    chosen = model or models[0].id
    owner = next((m.owned_by for m in models if m.id == chosen), None)
    native = tool_format == "native"
    if tool_format == "auto":
        try:
            client.chat.completions.create(
                model=chosen, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                tools=[{"type": "function", "function": {
                    "name": "noop", "parameters": {"type": "object", "properties": {}}}}])
            native = True
        except openai.BadRequestError:
            native = False
    return ServerInfo(model=chosen, is_vllm=owner == "vllm", native_tools=native)
