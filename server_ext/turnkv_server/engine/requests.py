"""The request bodies the router sends an engine over its OpenAI-compatible HTTP API.

A turn makes two (`prefill_request`, `decode_request`). Everything else the router asks of an
engine is a one-token completion over token IDs (`one_token_request`): the turnkv push back
over a session's history, bidirectional's capture of the decode engine's held blocks, and
instructions that are not part of a turn (end a session's leases, give a send up), which the
engines take only through their HTTP API. `/tokenize` (`tokenize_request`) renders a turn's
prompt as the engine will see it.
"""

from __future__ import annotations

from typing import Any

# vLLM's pull-based P/D: the prefill engine computes the prompt and keeps its blocks for a
# remote decode, which reads them with the params the prefill's response returns.
PREFILL_FOR_REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# What the prefill request may not carry from the client's: it makes one token, whole.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "max_completion_tokens")
# The chat fields that decide how a conversation renders into tokens.
_CHAT_RENDERING = ("messages", "tools", "chat_template", "chat_template_kwargs",
                   "add_generation_prompt", "continue_final_message")


def prefill_request(body: dict[str, Any], transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The client's request as a one-token prefill that returns its prompt's token IDs."""
    prefill = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    prefill["max_tokens"] = 1
    prefill["stream"] = False
    prefill["return_token_ids"] = True
    prefill["kv_transfer_params"] = transfer_params
    return prefill


def decode_request(body: dict[str, Any], transfer_params: dict[str, Any] | None,
                   token_ids: bool) -> dict[str, Any]:
    """The client's request with the decode engine's params (and token IDs asked for when the
    router keeps the session's history, or the client wants them)."""
    decode = dict(body)
    decode["kv_transfer_params"] = transfer_params
    if token_ids:
        decode["return_token_ids"] = True
    return decode


def one_token_request(model: str | None, prompt: list[int],
                      transfer_params: dict[str, Any],
                      cache_salt: str | None = None) -> dict[str, Any]:
    """A greedy one-token completion over `prompt`'s token IDs. Pass the turn's `cache_salt`
    when the request must hit (or fill) the turn's blocks: block hashes include the salt."""
    request: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                               "kv_transfer_params": transfer_params}
    if model is not None:
        request["model"] = model
    if cache_salt is not None:
        request["cache_salt"] = cache_salt
    return request


def tokenize_request(body: dict[str, Any]) -> dict[str, Any]:
    """The `/tokenize` body that renders `body`'s prompt (chat template applied) as a turn's."""
    request: dict[str, Any] = {"model": body.get("model")}
    if "messages" in body:
        request.update({k: body[k] for k in _CHAT_RENDERING if k in body})
        request.setdefault("add_generation_prompt", True)
    else:
        request["prompt"] = body.get("prompt")
    return request
