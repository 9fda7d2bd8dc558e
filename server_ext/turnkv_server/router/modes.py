"""Serving modes: what each engine is told for a turn, and what that says about the prompt.

A mode is the policy layer between the router's turn pipeline and vLLM's `kv_transfer_params`.
`standard` is vLLM's own pull-based P/D with round robin and no session reuse, the baseline;
`standard-nocache` is the same with the prefill engines' prefix cache off (launcher setting),
the baseline of vLLM's multi-turn blog.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turnkv.protocol import PromptTokens
from turnkv_server.router.sessions import Session

# The prefill engine computes the prompt and keeps its blocks for a remote decode.
PREFILL_FOR_REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class PrefillResult:
    transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    cached_tokens: int
    elapsed_ms: float


class Mode:
    """The `standard` mode; other modes override what differs."""

    name = "standard"
    # Whether a session's turns stick to the pair that served it.
    affinity = False

    def prefill_transfer_params(self, session: Session | None) -> dict[str, Any]:
        return dict(PREFILL_FOR_REMOTE_DECODE)

    def decode_transfer_params(
        self, prefill: PrefillResult, session: Session | None
    ) -> dict[str, Any] | None:
        return prefill.transfer_params

    def prompt_tokens(self, prefill: PrefillResult) -> PromptTokens:
        # On the prefill engine vLLM's cached_tokens is its own prefix-cache hit count. The
        # decode engine's split is not reported per request by the upstream connector.
        return PromptTokens(
            total=prefill.prompt_tokens,
            prefill_cached=prefill.cached_tokens,
            prefill_received=0,
            prefill_computed=prefill.prompt_tokens - prefill.cached_tokens,
        )


class StandardNoCache(Mode):
    name = "standard-nocache"


def make_mode(name: str) -> Mode:
    modes: dict[str, type[Mode]] = {"standard": Mode, "standard-nocache": StandardNoCache}
    try:
        return modes[name]()
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; choose one of {', '.join(modes)}") from None
