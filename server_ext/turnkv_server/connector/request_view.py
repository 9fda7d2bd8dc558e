"""The part of vLLM's `Request` the scheduler half reads (`scheduler_side`, `room`): a protocol,
so that those modules and their tests need no vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any, Protocol


class Request(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def block_hashes(self) -> Sequence[Any]: ...
    @property
    def status(self) -> Enum: ...
